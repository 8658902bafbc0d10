"""The checkpoint directory layout every run writes, whatever trains (docs/checkpointing.md).

Layout under `--save` (Megatron's names, so tooling recognises it)::

    latest_checkpointed_iteration.txt   the rollout id of the newest complete checkpoint; written LAST
    iter_0000007/                       one complete checkpoint (rollout 7 done)
        ...                             the train backend's shards (slime/backends/megatron/checkpoint.py)
        rollout/                        the RolloutManager's part: data-source state (epoch, offset, counters,
                                        buffer) and the carried-over groups (`carry_7.json`)
        slime_checkpoint.json           written by the driver when every part is in; marks the dir complete
    iter_0000008.tmp/                   a save in progress (or killed): never read, removed by the next save

Why the write-then-rename dance: a run killed during a save must resume from the previous checkpoint, so
nothing under `iter_*` is visible until it is complete, and the tracker moves only after the rename. Here, not in
a backend: the driver finds, begins and finishes checkpoints without importing torch (~2.5 CPU-seconds and ~1 s
of teardown per run), and a backend only fills the directory it is given.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

from slime.utils.atomic import atomic_open, replace_dir

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
MARKER = "slime_checkpoint.json"
FORMAT_VERSION = 1


def iter_dir(root: str, rollout_id: int) -> str:
    return os.path.join(root, f"iter_{rollout_id:07d}")


def read_tracker(root: str | None) -> int | None:
    """The rollout id in `root`'s tracker file, or None when there is no (readable) tracker."""
    if not root:
        return None
    path = os.path.join(root, TRACKER)
    try:
        with open(path, encoding="utf-8") as f:
            return int(f.read().strip())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise RuntimeError(f"{path} is corrupt ({e}); point --load at a valid checkpoint dir") from e


def find_checkpoint(root: str | None) -> tuple[int, str] | None:
    """(rollout id, dir) of the checkpoint to resume from, or None (no tracker: start fresh, as Megatron does)."""
    rollout_id = read_tracker(root)
    if rollout_id is None:
        if root:
            logger.info("no %s in %s: starting from --hf-checkpoint", TRACKER, root)
        return None
    path = iter_dir(root, rollout_id)
    if not os.path.isfile(os.path.join(path, MARKER)):
        raise RuntimeError(f"{root}/{TRACKER} names rollout {rollout_id} but {path} is not a complete checkpoint")
    return rollout_id, path


def begin_save(root: str, rollout_id: int) -> str:
    """Create (empty) `iter_XXXXXXX.tmp` for this save; stale `.tmp` dirs of killed saves are removed."""
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):
        if name.startswith("iter_") and name.endswith(".tmp"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    tmp = iter_dir(root, rollout_id) + ".tmp"
    os.makedirs(tmp)
    return tmp


def finish_save(root: str, rollout_id: int, meta: dict[str, Any]) -> str:
    """Mark the tmp dir complete, rename it into place, then move the tracker; returns the final dir."""
    tmp = iter_dir(root, rollout_id) + ".tmp"
    final = iter_dir(root, rollout_id)
    with atomic_open(os.path.join(tmp, MARKER)) as f:
        json.dump({"format_version": FORMAT_VERSION, **meta}, f, indent=1)
    replace_dir(tmp, final)  # an existing one: a resumed run re-saving an id the killed run had finished
    with atomic_open(os.path.join(root, TRACKER)) as f:
        f.write(str(rollout_id))
    logger.info("checkpoint of rollout %d complete: %s", rollout_id, final)
    return final
