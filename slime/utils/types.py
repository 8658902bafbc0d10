"""`Sample` and `Status`: the unit that flows from the rollout side to the trainer.

Naming: `group_index` is the prompt index (a GRPO prompt group); `group_id` is the *training aggregation
unit* — one rollout execution (trajectory). A trajectory that fans out into several samples (context
compaction, sub-agents) keeps one `group_id` on every segment, and the normaliser treats the group as one
long sample split into segments.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any


class Status(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


# SGLang's `meta_info.finish_reason.type` (python/sglang/srt/managers/schedule_batch.py: FINISH_LENGTH,
# FINISH_MATCHED_TOKEN/STR, FINISH_ABORT) mapped onto our status.
_FINISH_TO_STATUS = {"length": Status.TRUNCATED, "stop": Status.COMPLETED, "abort": Status.ABORTED}


@dataclass
class Sample:
    group_index: int | None = None
    index: int | None = None
    group_id: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: Any = None
    multimodal_train_inputs: Any = None
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    # One entry per `/generate` answer: [weight version, response tokens it produced, trained]. `trained` turns
    # False when --mask-offpolicy-in-partial-rollout masks the tokens out on resume. The staleness bound reads
    # it (slime/scheduling/staleness.py): one version per answer is exact because a weight sync aborts the
    # running requests first; with --update-weights-in-flight an answer may run through a sync, and its span
    # then takes the version it was sent under (a lower bound: staleness.bound_answer_version).
    weight_version_spans: list[list[Any]] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    # Per response token, scored on the rollout side by other models of --sglang-config: the OPD teacher(s)
    # (--use-opd --opd-type sglang) and the reference policy (--ref-model-name; beyond slime).
    teacher_log_probs: list[float] | None = None
    ref_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0
    spec_info: dict[str, Any] = field(default_factory=dict)
    prefix_cache_info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (used by rollout dumps and replay); `from_dict` inverts it exactly."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"Sample.from_dict: unknown field(s) {sorted(unknown)}")
        kwargs = dict(d)
        if "status" in kwargs:
            s = kwargs["status"]
            kwargs["status"] = s if isinstance(s, Status) else Status(s)
        return cls(**kwargs)

    def get_reward_value(self, args: Any) -> float:
        """The scalar reward; a dict reward is indexed by `--reward-key`."""
        if isinstance(self.reward, dict):
            key = args.reward_key
            if key is None:
                raise ValueError("Sample.reward is a dict; pass --reward-key to choose the scalar used for training")
            return float(self.reward[key])
        return float(self.reward) if self.reward is not None else 0.0

    @property
    def train_group_id(self) -> int:
        """The training aggregation unit: `group_id`, defaulting to the trajectory's `index` (slime v0.3.0's rule).
        Every place that groups samples for training asks this property, so the default lives here only."""
        gid = self.group_id if self.group_id is not None else self.index
        if gid is None:
            raise ValueError("a sample has neither group_id nor index; the data source must set Sample.index")
        return gid

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def update_from_meta_info(self, args: Any, meta_info: dict[str, Any]) -> None:
        """Fold an SGLang `/generate` answer's `meta_info` into the sample (status, weight version, cache stats)."""
        if (wv := meta_info.get("weight_version")) is not None:
            self.weight_versions.append(str(wv))
            if "completion_tokens" in meta_info:
                self.weight_version_spans.append([str(wv), int(meta_info["completion_tokens"]), True])
        if "cached_tokens" in meta_info:
            self.prefix_cache_info["cached_tokens"] = self.prefix_cache_info.get("cached_tokens", 0) + int(
                meta_info["cached_tokens"]
            )
            self.prefix_cache_info["prompt_tokens"] = self.prefix_cache_info.get("prompt_tokens", 0) + int(
                meta_info.get("prompt_tokens", 0)
            )
        finish = meta_info.get("finish_reason")
        if isinstance(finish, dict) and finish.get("type") in _FINISH_TO_STATUS:
            self.status = _FINISH_TO_STATUS[finish["type"]]
