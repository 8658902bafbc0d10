"""Data sources (`--data-source-path`): hand prompt groups to the rollout and take unfinished groups back.

Each group is `n_samples_per_prompt` deep copies of one prompt Sample. `group_index` (the prompt's running
number) and `index` (the trajectory's running number) are assigned here and never reused, so GRPO can
normalise by prompt and the trainer can aggregate by trajectory. The state (epoch, position, counters,
buffer) is saved as JSON so a resumed run hands out exactly the batches an uninterrupted run would have.
"""

from __future__ import annotations

import abc
import inspect
import json
import logging
import os
import pickle
import random
from typing import Any

from slime.rollout.dataset import Dataset, build_train_dataset, validate_prompt_data
from slime.rollout.filter_hub.buffer_filters import pop_first
from slime.utils.atomic import atomic_open
from slime.utils.misc import load_function
from slime.utils.types import Sample

__all__ = [
    "DataSource",
    "Dataset",
    "RolloutDataSource",
    "RolloutDataSourceWithBuffer",
    "validate_prompt_data",
]

logger = logging.getLogger(__name__)

_STATE_VERSION = 1


class DataSource(abc.ABC):
    @abc.abstractmethod
    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        """`num_groups` prompt groups of `n_samples_per_prompt` samples each."""

    @abc.abstractmethod
    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Take groups back (unfinished partial rollouts) to serve them again later."""

    @abc.abstractmethod
    def save(self, rollout_id: int, path_dir: str | None = None) -> None: ...

    @abc.abstractmethod
    def load(self, rollout_id: int | None, path_dir: str | None = None) -> None: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...


def call_with_checkpoint_dir(method: Any, rollout_id: int, path_dir: str) -> None:
    """`save` / `load` of a data source with the checkpoint's `rollout/` directory when it takes one.

    slime v0.3.0's `DataSource.save(rollout_id)` / `load(rollout_id=None)` take no directory and use
    `args.save` / `args.load` themselves; such a class (written against slime) is called that way, unchanged."""
    params = [
        p
        for p in inspect.signature(method).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    if len(params) >= 2:
        method(rollout_id, path_dir)
    else:
        method(rollout_id)


def state_path(path_dir: str, rollout_id: int) -> str:
    return os.path.join(path_dir, f"global_dataset_state_dict_{rollout_id}.json")


def read_state(path: str, what: str, fresh: str) -> dict[str, Any] | None:
    """The JSON state of `what` a checkpoint holds at `path`; None, and a line saying the run starts `fresh`,
    when it holds none (a checkpoint of a run without it)."""
    if not os.path.exists(path):
        logger.info("no %s at %s; %s", what, path, fresh)
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class RolloutDataSource(DataSource):
    """Epoch-wrapping iterator over `--prompt-data`, reshuffled per epoch with seed `rollout_seed + epoch`."""

    def __init__(self, args: Any, dataset: Dataset | None = None) -> None:
        self.args = args
        self.n_samples_per_prompt = args.n_samples_per_prompt
        if args.disable_rollout_global_dataset:
            self.dataset = None
        else:
            self.dataset = dataset if dataset is not None else build_train_dataset(args)
            if len(self.dataset) == 0:
                raise ValueError(f"--prompt-data {args.prompt_data}: no prompts")
        self.epoch_id = 0
        self.offset = 0  # position inside the current epoch's order
        self.sample_group_index = 0
        self.sample_index = 0
        self._order = self._epoch_order(0)

    @property
    def num_prompts(self) -> int:
        return 0 if self.dataset is None else len(self.dataset)

    def __len__(self) -> int:
        return self.num_prompts

    def _epoch_order(self, epoch_id: int) -> list[int]:
        order = list(range(self.num_prompts))
        if self.args.rollout_shuffle:
            random.Random(int(self.args.rollout_seed) + epoch_id).shuffle(order)
        return order

    def _next_prompt(self) -> Sample:
        if self.dataset is None:
            # No global dataset: the rollout function makes its own prompts (agents, environments); it still
            # gets groups with fresh indices.
            return Sample()
        if self.offset >= len(self._order):
            self.epoch_id += 1
            self.offset = 0
            self._order = self._epoch_order(self.epoch_id)
        prompt = self.dataset.samples[self._order[self.offset]]
        self.offset += 1
        return prompt

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        groups = []
        for _ in range(num_groups):
            # one independent copy per sample (siblings must not share metadata); a pickle round trip is that
            # deep copy at a fraction of copy.deepcopy's cost, which showed in rollouts of thousands of samples
            frozen = pickle.dumps(self._next_prompt(), protocol=pickle.HIGHEST_PROTOCOL)
            group = []
            for _ in range(self.n_samples_per_prompt):
                s = pickle.loads(frozen)
                s.group_index = self.sample_group_index
                s.index = self.sample_index
                self.sample_index += 1
                group.append(s)
            self.sample_group_index += 1
            groups.append(group)
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        raise RuntimeError(f"{type(self).__name__} is read-only; use RolloutDataSourceWithBuffer to add samples")

    def _state(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "epoch_id": self.epoch_id,
            "offset": self.offset,
            "sample_group_index": self.sample_group_index,
            "sample_index": self.sample_index,
            "num_prompts": self.num_prompts,
        }

    def _set_state(self, state: dict[str, Any]) -> None:
        if state.get("num_prompts") != self.num_prompts:
            logger.warning(
                "data source state was saved with %s prompts, the dataset now has %d; continuing anyway",
                state.get("num_prompts"),
                self.num_prompts,
            )
        self.epoch_id = int(state["epoch_id"])
        self.offset = int(state["offset"])
        self.sample_group_index = int(state["sample_group_index"])
        self.sample_index = int(state["sample_index"])
        self._order = self._epoch_order(self.epoch_id)

    def _dir(self, path_dir: str | None, base: str | None) -> str | None:
        if path_dir is not None:
            return path_dir
        return os.path.join(base, "rollout") if base else None

    def save(self, rollout_id: int, path_dir: str | None = None) -> None:
        """Write the state atomically (tmp file, then rename) so a crash mid-save never leaves a torn file."""
        d = self._dir(path_dir, self.args.save)
        if d is None:
            return
        with atomic_open(state_path(d, rollout_id)) as f:
            json.dump(self._state(), f)

    def load(self, rollout_id: int | None, path_dir: str | None = None) -> None:
        d = self._dir(path_dir, self.args.load)
        if d is None or rollout_id is None:
            return
        path = state_path(d, rollout_id)
        state = read_state(path, "data source state", "starting from the beginning")
        if state is None:
            return
        self._set_state(state)
        logger.info("data source resumed from %s (epoch %d, offset %d)", path, self.epoch_id, self.offset)


class RolloutDataSourceWithBuffer(RolloutDataSource):
    """The default: buffered groups (partial rollouts) are served first, through `--buffer-filter-path`."""

    def __init__(self, args: Any, dataset: Dataset | None = None) -> None:
        super().__init__(args, dataset)
        self.buffer: list[list[Sample]] = []
        path = args.buffer_filter_path
        self.buffer_filter = load_function(path) if path else pop_first

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        groups = self.buffer_filter(self.args, None, self.buffer, num_groups) if self.buffer and num_groups else []
        if len(groups) > num_groups:
            raise RuntimeError(f"buffer filter returned {len(groups)} groups; asked for at most {num_groups}")
        return groups + super().get_samples(num_groups - len(groups))

    def add_samples(self, groups: list[list[Sample]]) -> None:
        for g in groups:
            if len(g) != self.n_samples_per_prompt:
                raise ValueError(
                    f"a buffered group must hold n_samples_per_prompt={self.n_samples_per_prompt} samples, got {len(g)}"
                )
        self.buffer.extend(groups)

    def _state(self) -> dict[str, Any]:
        state = super()._state()
        state["buffer"] = [[_sample_to_json(s) for s in g] for g in self.buffer]
        return state

    def _set_state(self, state: dict[str, Any]) -> None:
        super()._set_state(state)
        self.buffer = [[_sample_from_json(s) for s in g] for g in state.get("buffer", [])]


def _sample_to_json(s: Sample | list[Sample]) -> Any:
    # a fan-out trajectory is a list of segments; keep that shape through the round trip
    return [x.to_dict() for x in s] if isinstance(s, list) else s.to_dict()


def _sample_from_json(d: Any) -> Sample | list[Sample]:
    return [Sample.from_dict(x) for x in d] if isinstance(d, list) else Sample.from_dict(d)
