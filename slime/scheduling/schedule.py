"""The per-rollout training schedule: optimizer steps by groups, micro-batches by tokens, DP assignment.

Runs on the rollout side (the RolloutManager) so the log-prob, ref and training passes of every rank replay
one plan. A *group* is one rollout execution (`Sample.group_id`); a trajectory that fanned out into several
samples is one group. The plan is built "pack first, distribute second":

1. Groups are taken in first-occurrence order, B = `global_batch_size` per optimizer step. A group's samples
   are never split across steps, so the per-group token denominators D_g (`denominators.py`) are step-local.
2. Groups that do not fill the last step are *left over*: the caller carries them to the next rollout
   (`slime.scheduling.carry`). With `allow_partial_last_step` they instead form a last step of b < B groups
   whose loss is divided by b and whose LR-scheduler increment is b. Nothing is padded.
3. Each step's samples are packed into micro-batches: dynamic (first-fit, capacity `max_tokens_per_gpu *
   cp_size`; an oversize sample sits alone) or static (consecutive chunks of `micro_batch_size`).
4. The micro-batch count K is raised to a multiple of dp (times the VPP micro-batch group size), by
   splitting the heaviest multi-sample micro-batches (dynamic only). If the step has too few samples for
   that, the remaining micro-batches are *empty* (`[]`): the trainer runs them as a zero-loss pass so every
   rank still runs the same count. Empty micro-batches hold no sample; they pad nothing.
5. The K micro-batches go to DP ranks round-robin, or token-balanced by Karmarkar–Karp with equal counts
   (`balance_data`). Every rank runs K/dp micro-batches per step (pipeline parallelism needs equal counts).

Invariants (tests/property/test_schedule*.py): every scheduled sample is placed exactly once; every rank has
the same number of micro-batches per step; every micro-batch respects the token cap unless it holds a single
oversize sample; empty micro-batches appear only when the step has fewer samples (dynamic) or chunks
(static) than micro-batch slots; no group spans two steps; scheduled + left-over = the input samples.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slime.scheduling.packing import first_fit, karmarkar_karp, split_bins
from slime.utils.errors import SlimeArgError

logger = logging.getLogger(__name__)


@dataclass
class StepSchedule:
    """One optimizer step. `micro_batches[r][j]` are global sample indices of rank r's j-th micro-batch."""

    group_ids: list[int]
    sample_indices: list[int]
    micro_batches: list[list[list[int]]]
    num_microbatches: int  # per DP rank
    global_batch_size: int  # b: groups in this step; the loss is divided by it
    configured_global_batch_size: int  # B

    @property
    def is_partial(self) -> bool:
        return self.global_batch_size < self.configured_global_batch_size

    @property
    def lr_increment(self) -> int:
        """Megatron's scheduler counts samples seen (here: groups), so a step of b groups advances it by b."""
        return self.global_batch_size


@dataclass
class Schedule:
    """The whole rollout's plan plus what was left over for the next rollout.

    `partitions[r]` lists the global sample indices rank r receives, in execution order;
    `micro_batch_indices[r][j]` are indices *into `partitions[r]`* (what the rank sees after shipping).
    """

    steps: list[StepSchedule]
    dp_size: int
    partitions: list[list[int]]
    micro_batch_indices: list[list[list[int]]]
    leftover_group_ids: list[int] = field(default_factory=list)
    leftover_sample_indices: list[int] = field(default_factory=list)

    @property
    def num_microbatches(self) -> list[int]:
        return [s.num_microbatches for s in self.steps]

    @property
    def global_batch_sizes(self) -> list[int]:
        return [s.global_batch_size for s in self.steps]

    @property
    def scheduled_sample_indices(self) -> list[int]:
        return [i for s in self.steps for i in s.sample_indices]


def group_samples(group_ids: Sequence[int]) -> dict[int, list[int]]:
    """group id -> its sample indices, groups in first-occurrence order (dicts keep insertion order)."""
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        if g is None:
            raise ValueError(f"sample {i} has no group id; set Sample.group_id (or Sample.index) before scheduling")
        groups.setdefault(g, []).append(i)
    return groups


def split_groups_into_steps(
    group_order: Sequence[int], global_batch_size: int, *, allow_partial_last_step: bool = False
) -> tuple[list[list[int]], list[int]]:
    """Chunk groups into steps of B; returns (steps, leftover groups). The one rule that decides carry-over."""
    if global_batch_size <= 0:
        raise SlimeArgError(f"--global-batch-size must be positive, got {global_batch_size}")
    n_full = len(group_order) // global_batch_size
    steps = [list(group_order[s * global_batch_size : (s + 1) * global_batch_size]) for s in range(n_full)]
    rest = list(group_order[n_full * global_batch_size :])
    if rest and allow_partial_last_step:
        return steps + [rest], []
    return steps, rest


def _alignment(dp_size: int, vpp_size: int, microbatch_group_size_per_vp_stage: int | None, pp_size: int) -> int:
    if vpp_size <= 1:
        return dp_size
    # Megatron's interleaved schedule runs micro-batches in groups of this size per virtual stage; its
    # default is the pipeline size (megatron/core/model_parallel_config.py).
    mb_group = microbatch_group_size_per_vp_stage or pp_size
    return dp_size * mb_group


def _pack_step(
    lengths: list[int],
    *,
    align: int,
    micro_batch_size: int,
    use_dynamic_batch_size: bool,
    capacity: int | None,
) -> list[list[int]]:
    """Micro-batches of one step as local indices into `lengths`, their count a multiple of `align`.

    When the step has too few samples (or, static, too few chunks) to give every rank its share, the count
    is completed with *empty* micro-batches rather than by breaking the token cap or failing mid-run: first
    -fit bins can never be merged within the cap, so there is no other way to equal per-rank counts.
    """
    if use_dynamic_batch_size:
        assert capacity is not None
        bins = first_fit(lengths, capacity)
    else:
        bins = [
            list(range(i, min(i + micro_batch_size, len(lengths)))) for i in range(0, len(lengths), micro_batch_size)
        ]
    target = max(align, -(-len(bins) // align) * align)
    if use_dynamic_batch_size:
        bins = split_bins(bins, lengths, target)
    if len(bins) < target:
        logger.warning(
            "an optimizer step of %d samples fills only %d of %d micro-batches (dp x microbatch-group = %d); "
            "%d micro-batch slots stay empty",
            len(lengths),
            len(bins),
            target,
            align,
            target - len(bins),
        )
        bins = bins + [[] for _ in range(target - len(bins))]
    return bins


def build_schedule(
    total_lengths: Sequence[int],
    group_ids: Sequence[int],
    *,
    global_batch_size: int,
    dp_size: int,
    cp_size: int = 1,
    pp_size: int = 1,
    vpp_size: int = 1,
    microbatch_group_size_per_vp_stage: int | None = None,
    micro_batch_size: int = 1,
    use_dynamic_batch_size: bool = False,
    max_tokens_per_gpu: int | None = None,
    balance_data: bool = False,
    allow_partial_last_step: bool = False,
) -> Schedule:
    """Plan the optimizer steps of one rollout. See the module docstring for the rules and invariants."""
    if len(total_lengths) != len(group_ids):
        raise ValueError(f"{len(total_lengths)} lengths but {len(group_ids)} group ids")
    if dp_size <= 0 or cp_size <= 0:
        raise ValueError(f"dp_size and cp_size must be positive, got dp={dp_size} cp={cp_size}")
    capacity = None
    if use_dynamic_batch_size:
        if not max_tokens_per_gpu or max_tokens_per_gpu <= 0:
            raise SlimeArgError("--use-dynamic-batch-size needs a positive --max-tokens-per-gpu")
        capacity = max_tokens_per_gpu * cp_size  # a CP rank holds ~1/cp of each packed sequence
    elif micro_batch_size <= 0:
        raise SlimeArgError(f"--micro-batch-size must be positive, got {micro_batch_size}")
    align = _alignment(dp_size, vpp_size, microbatch_group_size_per_vp_stage, pp_size)

    groups = group_samples(group_ids)
    step_groups, leftover = split_groups_into_steps(
        list(groups), global_batch_size, allow_partial_last_step=allow_partial_last_step
    )
    steps: list[StepSchedule] = []
    partitions: list[list[int]] = [[] for _ in range(dp_size)]
    mb_indices: list[list[list[int]]] = [[] for _ in range(dp_size)]
    for gs in step_groups:
        sample_idx = [i for g in gs for i in groups[g]]
        lengths = [int(total_lengths[i]) for i in sample_idx]
        bins = _pack_step(
            lengths,
            align=align,
            micro_batch_size=micro_batch_size,
            use_dynamic_batch_size=use_dynamic_batch_size,
            capacity=capacity,
        )
        k = len(bins)
        if balance_data:
            rank_bins = karmarkar_karp([sum(lengths[i] for i in b) for b in bins], dp_size, equal_size=True)
        else:
            rank_bins = [list(range(r, k, dp_size)) for r in range(dp_size)]
        step_mbs: list[list[list[int]]] = []
        for r in range(dp_size):
            rank_mbs = [[sample_idx[i] for i in bins[b]] for b in rank_bins[r]]
            step_mbs.append(rank_mbs)
            for mb in rank_mbs:
                start = len(partitions[r])
                partitions[r].extend(mb)
                mb_indices[r].append(list(range(start, start + len(mb))))
        steps.append(
            StepSchedule(
                group_ids=list(gs),
                sample_indices=sample_idx,
                micro_batches=step_mbs,
                num_microbatches=k // dp_size,
                global_batch_size=len(gs),
                configured_global_batch_size=global_batch_size,
            )
        )
    return Schedule(
        steps=steps,
        dp_size=dp_size,
        partitions=partitions,
        micro_batch_indices=mb_indices,
        leftover_group_ids=list(leftover),
        leftover_sample_indices=[i for g in leftover for i in groups[g]],
    )


def build_schedule_from_args(
    args: Any,
    samples: Sequence[Any],
    parallel_config: Mapping[str, int] | Any,
    total_lengths: Sequence[int] | None = None,
) -> Schedule:
    """`build_schedule` for a list of `Sample`s; `parallel_config` has dp_size, cp_size[, pp_size, vpp_size,
    microbatch_group_size_per_vp_stage] as a dict or attributes. `total_lengths` (default: the samples' token
    counts) are what the trainer will pack."""

    def pc(name: str, default: Any) -> Any:
        if isinstance(parallel_config, Mapping):
            value = parallel_config.get(name, default)
        else:
            value = getattr(parallel_config, name, default)
        return default if value is None else value

    return build_schedule(
        list(total_lengths) if total_lengths is not None else [len(s.tokens) for s in samples],
        [s.train_group_id for s in samples],
        global_batch_size=args.global_batch_size,
        dp_size=pc("dp_size", 1),
        cp_size=pc("cp_size", 1),
        pp_size=pc("pp_size", 1),
        vpp_size=pc("vpp_size", 1),
        microbatch_group_size_per_vp_stage=pc("microbatch_group_size_per_vp_stage", None),
        micro_batch_size=args.micro_batch_size,
        use_dynamic_batch_size=bool(args.use_dynamic_batch_size),
        max_tokens_per_gpu=args.max_tokens_per_gpu,
        balance_data=bool(args.balance_data),
        allow_partial_last_step=bool(args.allow_partial_last_step),
    )
