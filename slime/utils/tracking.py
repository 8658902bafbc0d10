"""Metric tracking for the driver: a JSONL log, TensorBoard scalars, and a progress helper for the main loop.

Why JSONL first: it is greppable, diffable and survives crashes line by line (each record is flushed), so
tests and `bench/` scripts read metrics without TensorBoard. TensorBoard is the human view of the same
numbers. Several processes may log into one directory (the driver logs train metrics, the RolloutManager
actor rollout/eval metrics): each JSONL record is one `write` on an O_APPEND descriptor, so lines never
interleave, and each process's SummaryWriter writes its own event file, which TensorBoard merges.
Training ranks reduce their metrics through `ParallelState` before they reach a tracker.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import sys
import time
from typing import IO, Any

logger = logging.getLogger(__name__)

KINDS = ("rollout", "train", "eval")


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
        if not self.metrics_dir:
            return
        os.makedirs(self.metrics_dir, exist_ok=True)
        path = os.path.join(self.metrics_dir, "metrics.jsonl")
        self._jsonl_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if args.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard import costs ~1 s

            self._tb = SummaryWriter(log_dir=os.path.join(self.metrics_dir, "tb"))

    def log(self, metrics: dict[str, Any], step: int, kind: str = "train") -> None:
        """Record one step's metrics; TensorBoard tags are `{kind}/{key}` (keys already prefixed stay as is)."""
        if kind not in KINDS:
            raise ValueError(f"metric kind must be one of {KINDS}, got {kind!r}")
        now = time.time()
        if self._jsonl_fd is not None:
            record = {"step": int(step), "kind": kind, "wall_time": now, "metrics": _to_plain(metrics)}
            os.write(self._jsonl_fd, (json.dumps(record, allow_nan=False) + "\n").encode())
        if self._tb is not None:
            for key, value in metrics.items():
                v = _scalar(value)
                if v is None:
                    continue  # non-scalar values live in the JSONL only
                tag = key if key.startswith(f"{kind}/") else f"{kind}/{key}"
                self._tb.add_scalar(tag, v, global_step=int(step), walltime=now)
            self._tb.flush()
        logger.debug("%s step %d: %s", kind, step, metrics)

    def close(self) -> None:
        if self._jsonl_fd is not None:
            os.close(self._jsonl_fd)
            self._jsonl_fd = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fmt_seconds(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """Main-loop progress: a tqdm bar on a terminal; otherwise one `logging` line per step (CI, Ray logs, files).

    Why both: a bar redraws in place, which turns into thousands of garbage lines in a log file, while a
    headless run still needs to say how far it got and how long is left.
    """

    def __init__(self, total: int, desc: str, stream: IO[str] | None = None, start: int = 0) -> None:
        self.total = total
        self.desc = desc
        self.n = start
        self._start_n = start
        self._t0 = time.monotonic()
        stream = stream if stream is not None else sys.stderr
        self.interactive = bool(getattr(stream, "isatty", lambda: False)())
        self._bar = None
        if self.interactive:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, desc=desc, file=stream, dynamic_ncols=True)

    def update(self, n: int = 1, **postfix: Any) -> None:
        """Advance by `n` steps; `postfix` (e.g. reward=0.5) is shown on the bar / appended to the log line."""
        self.n += n
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(n)
            return
        elapsed = time.monotonic() - self._t0
        done = self.n - self._start_n
        eta = elapsed / done * (self.total - self.n) if done > 0 else float("nan")
        extra = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in postfix.items())
        pct = 100.0 * self.n / self.total if self.total else 100.0
        eta_s = _fmt_seconds(eta) if math.isfinite(eta) else "?"
        logger.info(
            "%s: %d/%d (%.0f%%) elapsed %s eta %s%s",
            self.desc,
            self.n,
            self.total,
            pct,
            _fmt_seconds(elapsed),
            eta_s,
            f" {extra}" if extra else "",
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(total: int, desc: str, stream: IO[str] | None = None, start: int = 0) -> Progress:
    """A `Progress` for `total` steps (resume with `start`); use as a context manager so the bar is closed."""
    return Progress(total, desc, stream=stream, start=start)
