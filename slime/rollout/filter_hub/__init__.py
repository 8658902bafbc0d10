"""Pluggable filters: dynamic sampling (`--dynamic-sampling-filter-path`) and buffer (`--buffer-filter-path`)."""

from slime.rollout.filter_hub.base_types import DynamicFilterOutput, call_dynamic_filter
from slime.rollout.filter_hub.buffer_filters import pop_first
from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std

__all__ = ["DynamicFilterOutput", "call_dynamic_filter", "check_reward_nonzero_std", "pop_first"]
