"""Metric tracking for the driver: a JSONL log, TensorBoard scalars, optionally Weights & Biases, and the
progress line of the main loop.

Why JSONL first: it is greppable, diffable and survives crashes line by line (each record is flushed), so
tests and `bench/` scripts read metrics without TensorBoard. TensorBoard and W&B are human views of the same
numbers. Only the driver logs: the RolloutManager hands its rollout and eval metrics back with its results, and
training ranks reduce theirs through `ParallelState`, so one W&B run holds everything. Each JSONL record is one
`write` on an O_APPEND descriptor, so a resumed run (or a tool) appending to the same file never interleaves.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import time
from typing import Any

logger = logging.getLogger(__name__)

KINDS = ("rollout", "train", "eval", "startup")


def _to_plain(value: Any) -> Any:
    """JSON-able form of a metric value: tensors/numpy scalars become floats, NaN/inf become None (strict JSON)."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if hasattr(value, "tolist"):
        return _to_plain(value.tolist())
    return value if isinstance(value, str) or value is None else str(value)


def _scalar(value: Any) -> float | None:
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, numbers.Real):  # bool included: logged as 0/1
        return float(value)
    return None


class Tracker:
    """Writes `{metrics_dir}/metrics.jsonl` and, with `args.use_tensorboard`, TensorBoard events in `{metrics_dir}/tb`.

    Without `args.metrics_dir` nothing is written and metrics only go to `logging` at DEBUG level.
    The JSONL file is opened in append mode so a resumed run continues the same file.
    """

    def __init__(self, args: Any) -> None:
        self.metrics_dir: str | None = args.metrics_dir
        self._jsonl_fd: int | None = None
        self._tb = None
        self._wandb = None
        if not self.metrics_dir:
            return
        os.makedirs(self.metrics_dir, exist_ok=True)
        path = os.path.join(self.metrics_dir, "metrics.jsonl")
        self._jsonl_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if args.use_tensorboard:
            # tensorboard's own event writer (what torch's SummaryWriter wraps): the driver need not import torch
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            self._tb = EventFileWriter(os.path.join(self.metrics_dir, "tb"))
        if args.use_wandb:
            self._wandb = _init_wandb(args, self.metrics_dir)

    def log(self, metrics: dict[str, Any], step: int, kind: str = "train") -> None:
        """Record one step's metrics; TensorBoard tags are `{kind}/{key}` (keys already prefixed stay as is)."""
        if kind not in KINDS:
            raise ValueError(f"metric kind must be one of {KINDS}, got {kind!r}")
        now = time.time()
        if self._jsonl_fd is not None:
            record = {"step": int(step), "kind": kind, "wall_time": now, "metrics": _to_plain(metrics)}
            os.write(self._jsonl_fd, (json.dumps(record, allow_nan=False) + "\n").encode())
        if self._tb is not None:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary

            values = []
            for key, value in metrics.items():
                v = _scalar(value)
                if v is None:
                    continue  # non-scalar values live in the JSONL only
                tag = key if key.startswith(f"{kind}/") else f"{kind}/{key}"
                values.append(Summary.Value(tag=tag, simple_value=v))
            self._tb.add_event(Event(wall_time=now, step=int(step), summary=Summary(value=values)))
            self._tb.flush()
        if self._wandb is not None:
            scalars = {(k if k.startswith(f"{kind}/") else f"{kind}/{k}"): _scalar(v) for k, v in metrics.items()}
            self._wandb.log({k: v for k, v in scalars.items() if v is not None}, step=int(step))
        logger.debug("%s step %d: %s", kind, step, metrics)

    def close(self) -> None:
        if self._jsonl_fd is not None:
            os.close(self._jsonl_fd)
            self._jsonl_fd = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            # finish() can return before W&B's service process has written the run's last records (an offline
            # run's file then lacks its history for a moment, or for good if this process ends at once); teardown
            # waits for the service to exit, so the files are complete when close() returns
            wandb.teardown()
            self._wandb = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _init_wandb(args: Any, metrics_dir: str) -> Any:
    """A W&B run with the job's flags as config; files under METRICS_DIR/wandb (offline runs stay there)."""
    import wandb

    config = {k: _to_plain(v) for k, v in sorted(vars(args).items())}
    os.environ.setdefault("WANDB_SILENT", "true")  # its banner would break the one-line-per-rollout console
    return wandb.init(
        project=args.wandb_project,
        group=args.wandb_group,
        mode=args.wandb_mode,
        dir=metrics_dir,
        config=config,
        name=os.path.basename(os.path.abspath(metrics_dir)),
    )


def _fmt_seconds(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


# phases of one step as they appear in the progress line (metric key -> short name), in loop order
PHASES = (
    ("time/eval", "eval"),
    ("time/rollout", "rollout"),
    ("time/engine_release", "release"),
    ("time/log_probs", "log-probs"),
    ("time/train", "train"),
    ("time/save", "save"),
    ("time/weight_sync", "sync"),
    ("time/engine_resume", "resume"),
)


def step_line(metrics: dict[str, Any], eval_metrics: dict[str, Any] | None = None) -> str:
    """The console's summary of one rollout: reward, latest eval reward(s), step time and where it went."""
    parts = []
    reward = metrics.get("rollout/raw_reward_mean")
    if reward is not None:
        parts.append(f"reward {reward:.3f}")
    if (loss := metrics.get("train/loss")) is not None:
        parts.append(f"loss {loss:.4g}")
    for key, value in sorted((eval_metrics or {}).items()):
        if key.startswith("eval/") and "/" not in key[5:] and isinstance(value, numbers.Real):
            parts.append(f"{key} {value:.3f}")
    if (step := metrics.get("time/step")) is not None:
        phases = " ".join(f"{name} {metrics[k]:.1f}" for k, name in PHASES if metrics.get(k) is not None)
        parts.append(f"{step:.1f}s [{phases}]" if phases else f"{step:.1f}s")
    return " | ".join(parts)


def startup_line(startup: dict[str, float]) -> str:
    """'41.2s (ray_init 3.1s, rollout_servers 17.0s, ...)': the start-up cost of a run, phase by phase."""
    phases = ", ".join(f"{k.split('/', 1)[1]} {v:.1f}s" for k, v in startup.items() if k != "startup/total")
    return f"{startup.get('startup/total', 0.0):.1f}s ({phases})"


class Progress:
    """Main-loop progress as one log line per step: how far, how long left, and a caller's summary of the step.

    Why lines and not a redrawn bar: every step's numbers stay readable afterwards, in a terminal, in CI and in a
    log file alike.
    """

    def __init__(self, total: int, desc: str, start: int = 0) -> None:
        self.total = total
        self.desc = desc
        self.n = start
        self._start_n = start
        self._t0 = time.monotonic()

    def update(self, n: int = 1, detail: str = "", **postfix: Any) -> None:
        """Advance by `n` steps and log the line; `detail` and `postfix` (e.g. reward=0.5) are appended."""
        self.n += n
        elapsed = time.monotonic() - self._t0
        done = self.n - self._start_n
        eta = elapsed / done * (self.total - self.n) if done > 0 else float("nan")
        extra = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in postfix.items())
        eta_s = _fmt_seconds(eta) if math.isfinite(eta) else "?"
        text = " | ".join(x for x in (detail, extra) if x)
        logger.info(
            "%s %d/%d%s | elapsed %s eta %s", self.desc, self.n, self.total, f" | {text}" if text else "",
            _fmt_seconds(elapsed), eta_s,
        )  # fmt: skip

    def close(self) -> None:
        pass

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(total: int, desc: str, start: int = 0) -> Progress:
    """A `Progress` for `total` steps (resume with `start`)."""
    return Progress(total, desc, start=start)
