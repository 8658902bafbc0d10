"""Pure scheduling (no Ray, HTTP or megatron): optimizer steps by groups, micro-batches by tokens, DP
assignment, per-group token denominators and the carry-over of groups that do not fill a step."""

from slime.scheduling.carry import CarriedGroup, CarryBuffer, TrainBatch
from slime.scheduling.denominators import group_mask_sums, sample_loss_mask, sample_mask_sums
from slime.scheduling.schedule import (
    Schedule,
    StepSchedule,
    build_schedule,
    build_schedule_from_args,
)

__all__ = [
    "CarriedGroup",
    "CarryBuffer",
    "Schedule",
    "StepSchedule",
    "TrainBatch",
    "build_schedule",
    "build_schedule_from_args",
    "group_mask_sums",
    "sample_loss_mask",
    "sample_mask_sums",
]
