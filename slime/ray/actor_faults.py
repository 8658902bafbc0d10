"""A run's actor faults as one record: which actor, died or hung, during which event, and where to resume.

Two faults end a run that nothing inside it can repair, and both must be seen within seconds, not at the
distributed timeout:

- **died**: the actor's process is gone (SIGKILL, `os._exit`, a segfault, the OOM killer). Ray fails every call
  on it at once (`ActorDiedError`, ~0.1-0.4 s after the death on one node); `get_within` raises the first such
  error as soon as it is in, while the other ranks of the step may still wait in a collective for the dead one.
- **hung**: the process lives but a call does not come back (a deadlock, a collective whose peer is stuck). Only
  a deadline can tell: `--train-hang-timeout` bounds each train-rank call (step, save, weight sync),
  `--rollout-hang-timeout` each RolloutManager call (rollout, eval, save, the engines' lock); off by default.

A server process the run started (the router, an engine) that is gone when a rollout fails because of it counts as
died too (`ServerDied`, raised by the RolloutManager; with `--use-fault-tolerance` a dead engine is replaced
inside the rollout instead). Any other Python exception raised by an actor is its own error, reported as it is (a
restart would repeat it). The driver turns a fault into an `ActorFault`: `slime train` prints its one line, writes it to
METRICS_DIR/fault.json, and the restart supervisor (`slime/ray/restarts.py`) reads it from there.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

FAULT_FILE = "fault.json"
RESTARTABLE = ("died", "hung")


class ActorHung(Exception):
    """A call on `actor` gave no answer within `timeout` seconds."""

    def __init__(self, actor: str, call: str, timeout: float) -> None:
        super().__init__(f"{actor}: {call} gave no answer in {timeout:g} s")
        self.actor, self.call, self.timeout = actor, call, timeout


class ServerDied(Exception):
    """A server process of the run (the router, an engine) is gone and the call that needed it failed (raised by
    the RolloutManager, so it crosses Ray: its args are its state)."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(name, detail)
        self.name, self.detail = name, detail

    def __str__(self) -> str:
        return f"{self.name}: {self.detail}"


@dataclass
class ActorFault(Exception):
    actor: str  # train_rank0, critic_rank1, rollout_manager, or an actor's class name
    fault: str  # died | hung
    detail: str
    event: str | None = None  # the loop's event it happened in, e.g. "train 3"
    checkpoint: str | None = None  # the newest complete checkpoint dir, None: the run starts over
    checkpoint_rollout: int | None = None

    def __str__(self) -> str:
        return self.line()

    def line(self) -> str:
        """The one line a failed run ends with."""
        during = f" during {self.event}" if self.event else ""
        if self.checkpoint:
            resume = f"resume from rollout {self.checkpoint_rollout}'s checkpoint with --load {self.checkpoint_root}"
        else:
            resume = "no complete checkpoint yet: a rerun starts over"
        return f"{self.actor} {self.fault}{during} ({self.detail}); {resume}"

    @property
    def checkpoint_root(self) -> str | None:
        return os.path.dirname(self.checkpoint.rstrip("/")) if self.checkpoint else None

    def write(self, metrics_dir: str) -> str:
        os.makedirs(metrics_dir, exist_ok=True)
        path = os.path.join(metrics_dir, FAULT_FILE)
        with open(path, "w") as f:
            json.dump({**asdict(self), "time": time.time()}, f)
        return path


def read_fault(metrics_dir: str) -> dict[str, Any] | None:
    path = os.path.join(metrics_dir, FAULT_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def actor_names(trainer: Any, manager: Any) -> dict[str, str]:
    """{actor id hex: the name a fault line uses} for the run's own actors."""
    names = {}
    if manager is not None:
        names[manager._actor_id.hex()] = "rollout_manager"
    for role, ranks in trainer.ranks.items() if trainer is not None else ():
        for i, handle in enumerate(ranks):
            names[handle._actor_id.hex()] = f"train_rank{i}" if role == "actor" else f"{role}_rank{i}"
    return names


def classify(exc: BaseException, names: dict[str, str]) -> tuple[str, str, str] | None:
    """(actor, died | hung, detail) when `exc` is an actor fault, else None. Ray wraps an error raised by a call
    that itself waited on a dead actor (an engine under the manager): the innermost one names the actor."""
    from ray.exceptions import RayActorError, RayTaskError  # here: the restart supervisor never imports Ray

    seen = 0
    while isinstance(exc, RayTaskError) and getattr(exc, "cause", None) is not None and seen < 8:
        exc, seen = exc.cause, seen + 1
    if isinstance(exc, ServerDied):
        return exc.name, "died", exc.detail
    if isinstance(exc, ActorHung):
        return exc.actor, "hung", f"{exc.call} gave no answer in {exc.timeout:g} s"
    if isinstance(exc, RayActorError):
        actor_id = getattr(exc, "actor_id", None) or ""
        name = names.get(actor_id) or _class_name(str(exc)) or f"actor {actor_id[:12]}"
        pid = _field(str(exc), "pid")
        return name, "died", f"its process{f' {pid}' if pid else ''} exited"
    return None


def _field(message: str, key: str) -> str | None:
    for line in message.splitlines():
        line = line.strip()
        if line.startswith(f"{key}: "):
            return line[len(key) + 2 :]
    return None


def _class_name(message: str) -> str | None:
    return _field(message, "class_name")


def get_within(refs: Sequence[Any], timeout: float | None, names: Sequence[str], call: str) -> list[Any]:
    """`ray.get(refs)`, except that the first failed ref raises at once (a dead rank is reported while the others
    wait for it in a collective), and with `timeout` the ranks not done by then raise `ActorHung`."""
    import ray

    refs = list(refs)
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = list(refs)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            late = [names[refs.index(r)] for r in pending]
            raise ActorHung(", ".join(late), call, timeout or 0.0)
        ray.get(ready)  # raises the actor's error now
    return ray.get(refs)


async def await_within(ref: Any, timeout: float | None, actor: str, call: str) -> Any:
    """`await ref`, bounded by `timeout` seconds (None: unbounded); a late answer raises `ActorHung`."""
    if timeout is None:
        return await ref
    try:
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout)
    except TimeoutError:
        raise ActorHung(actor, call, timeout) from None


def fault_of(
    exc: BaseException, trainer: Any, manager: Any, events: list[tuple[str, int]], save_root: str | None
) -> ActorFault | None:
    """The run's `exc` as an `ActorFault` (None: not an actor fault), with the loop's last event and the newest
    complete checkpoint under `save_root`."""
    found = classify(exc, actor_names(trainer, manager))
    if found is None:
        return None
    from slime.utils import checkpoint_dirs

    ckpt = checkpoint_dirs.find_checkpoint(save_root) if save_root else None
    event = f"{events[-1][0]} {events[-1][1]}" if events else "start-up"
    return ActorFault(
        *found, event=event, checkpoint=ckpt[1] if ckpt else None, checkpoint_rollout=ckpt[0] if ckpt else None
    )
