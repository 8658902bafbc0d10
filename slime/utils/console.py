"""What reaches the console, and what goes to log files instead.

The driver's console carries one line per rollout (`tracking.Progress`) and errors. Every Ray actor writes its
full log to METRICS_DIR/logs/<name>.log and prints only warnings and errors (all of it at --log-level DEBUG).
Warnings that third-party libraries raise on every import in every process, and that say nothing about the
run (megatron-core falling back from Apex/TransformerEngine on a host without them, its own deprecations),
are filtered where each process starts, through PYTHONWARNINGS in the environment Ray gives its workers.
"""

from __future__ import annotations

import logging
import os
import warnings

# Message prefixes (PYTHONWARNINGS matches the start of the message, case-insensitively).
KNOWN_WARNINGS = (
    "Transformer Engine and Apex are not installed",  # megatron-core on a host without Apex/TE
    "Apex is not installed",
    "full scope is deprecated",  # megatron-core's TransformerConfig default for CUDA graphs
    "The cuda.cudart module is deprecated",
    "torch.distributed._sharded_tensor will be deprecated",
)
NOISY_LOGGERS = ("httpx", "httpcore", "urllib3", "filelock", "aiohttp.access")
FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def pythonwarnings() -> str:
    """A PYTHONWARNINGS value ignoring KNOWN_WARNINGS (kept after whatever the user set)."""
    ours = ",".join(f"ignore:{m}" for m in KNOWN_WARNINGS)
    user = os.environ.get("PYTHONWARNINGS")
    return f"{user},{ours}" if user else ours


def filter_known_warnings() -> None:
    """The same filters for a process that is already running (the driver)."""
    for message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=f"(?i){message}")


def configure_driver(level: str) -> None:
    filter_known_warnings()
    logging.basicConfig(level=level, format=FORMAT, force=True)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def configure_actor(log_level: str, metrics_dir: str | None, name: str) -> str | None:
    """An actor's logging: everything (INFO and up) to METRICS_DIR/logs/<name>.log, warnings to the console.

    Returns the log file's path (None without a metrics dir), for error messages that point at it."""
    filter_known_warnings()
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    console = logging.StreamHandler()
    console.setLevel(logging.DEBUG if log_level == "DEBUG" else logging.WARNING)
    console.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(console)
    path = None
    if metrics_dir:
        path = os.path.join(metrics_dir, "logs", f"{name}.log")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        file = logging.FileHandler(path)
        file.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(file)
    root.setLevel(logging.DEBUG if log_level == "DEBUG" else logging.INFO)
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return path
