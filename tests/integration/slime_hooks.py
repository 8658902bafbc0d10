"""Hooks written against slime v0.3.0's signatures, used by test_hooks_e2e.py through the real `slime train` CLI.

Each appends one JSON line per call to the file named by $SLIME_HOOK_LOG, so the test sees, from outside the
run, which hook ran, where and with what. The data source below is written the way a slime v0.3.0 user writes
one: it subclasses the `DataSource` ABC and saves / loads its own state under `args.save` / `args.load`.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch

from slime.ray.train_data import samples_to_train_data
from slime.rollout.data_source import DataSource
from slime.utils.types import Sample

ADVANTAGE = 0.5  # what the postprocess hook sets, token by token; the custom loss checks it arrived


def record(hook: str, **facts: Any) -> None:
    with open(os.environ["SLIME_HOOK_LOG"], "a") as f:
        f.write(json.dumps({"hook": hook, "pid": os.getpid(), **facts}) + "\n")


# ---- rollout side (RolloutManager) ------------------------------------------------------------------------------
def convert(args: Any, samples: list[Sample]) -> dict:
    data = samples_to_train_data(args, samples)
    data["hook_mark"] = [7] * len(samples)
    record("convert", n=len(samples))
    return data


def rollout_log(rollout_id: int, args: Any, samples: list[Sample], extra: dict, rollout_time: float) -> bool:
    record("rollout_log", rollout_id=rollout_id, n=len(samples), time=rollout_time)
    return rollout_id == 0  # True: slime skips its own logging of this rollout


def eval_log(rollout_id: int, args: Any, data: dict, extra: dict | None) -> bool:
    record("eval_log", rollout_id=rollout_id, datasets=sorted(data))
    return False


class SlimeStyleDataSource(DataSource):
    """A v0.3.0-style data source: one-argument save/load against args.save / args.load."""

    def __init__(self, args: Any) -> None:
        self.args = args
        with open(args.prompt_data) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]
        self.offset = self.sample_index = self.group_index = 0
        self.buffer: list[list[Sample]] = []

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = []
        for _ in range(num_samples):
            row = self.rows[self.offset % len(self.rows)]
            self.offset += 1
            prompt = Sample(prompt=row["input"], label=row["label"], metadata=dict(row.get("metadata") or {}))
            group = []
            for _ in range(self.args.n_samples_per_prompt):
                s = copy.deepcopy(prompt)
                s.group_index, s.index = self.group_index, self.sample_index
                self.sample_index += 1
                group.append(s)
            self.group_index += 1
            groups.append(group)
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        self.buffer.extend(samples)

    def save(self, rollout_id):
        path = os.path.join(self.args.save, f"rollout/global_dataset_state_dict_{rollout_id}.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"offset": self.offset, "sample_index": self.sample_index, "group_index": self.group_index}, path)
        record("data_source_save", rollout_id=rollout_id, offset=self.offset)

    def load(self, rollout_id=None):
        path = os.path.join(self.args.load, f"rollout/global_dataset_state_dict_{rollout_id}.pt")
        state = torch.load(path)
        self.offset, self.sample_index, self.group_index = state["offset"], state["sample_index"], state["group_index"]
        record("data_source_load", rollout_id=rollout_id, offset=self.offset)

    def __len__(self) -> int:
        return len(self.rows)


# ---- train side (train actors) ----------------------------------------------------------------------------------
def before_log_prob(args: Any, model: Any, store_prefix: str) -> None:
    record("before_log_prob", store_prefix=store_prefix, model_is_list=isinstance(model, list))


def before_train_step(args: Any, rollout_id: int, step_id: int, model: Any, optimizer: Any, scheduler: Any) -> None:
    record(
        "before_train_step", rollout_id=rollout_id, step_id=step_id, lr=optimizer.param_groups[0]["lr"],
        has_scheduler=hasattr(scheduler, "step"), env_mark=os.environ.get("SLIME_HOOK_TRAIN_MARK"),
    )  # fmt: skip


def postprocess(args: Any, rollout_id: int, rollout_data: dict) -> None:
    """With --disable-compute-advantages-and-returns the advantages come from here."""
    record(
        "postprocess", rollout_id=rollout_id, keys=sorted(rollout_data), had_advantages="advantages" in rollout_data,
        hook_mark=sorted(set(rollout_data["hook_mark"])),
    )  # fmt: skip
    rollout_data["advantages"] = [torch.full_like(m, ADVANTAGE) for m in rollout_data["loss_masks"]]


def custom_loss(args: Any, batch: dict, logits: torch.Tensor, reduce: Any) -> tuple[torch.Tensor, dict]:
    """A loss that reaches the model only through the logits it is handed (slime's custom_loss contract)."""
    adv = torch.cat(list(batch["advantages"]))
    record(
        "custom_loss", logits_shape=list(logits.shape), requires_grad=logits.requires_grad,
        advantages_ok=bool(torch.all(adv == ADVANTAGE)),
    )  # fmt: skip
    per_sample = [a * 0 for a in batch["advantages"]]  # the reducer keeps slime's group normalisation in play
    loss = logits.float().pow(2).mean() * 1e-3 + reduce(per_sample)
    return loss, {"loss": loss.detach()}
