"""The scheduling simulator's workload: heavy-tailed response lengths, engine speed, trainer speed.

The default describes a long chain-of-thought RL job of a ~7B model on 16 GPUs, 8 serving and 8 training:

- **Responses**: lognormal lengths, median 2,048 tokens, σ = 0.8 (mean ≈ 2,820; 1 in 27 samples longer than
  8,500 tokens; a 512-sample batch's longest usually hits the 16,384-token cap), clipped to [16, 16,384].
  Long-CoT math rollouts look like this: most answers are a few thousand tokens, a few run to the cap.
- **Prompts**: lognormal, median 512 tokens, σ = 0.3, clipped to [64, 2,048].
- **Engines**: 8, each running at most 64 requests (continuous batching). One decode step advances every
  running request by one token and takes 18 ms + 0.2 ms per running request (30.8 ms at 64: ≈ 2,100 tokens/s
  per engine). Prefill costs 0.02 ms per context token and stalls the engine's batch while it runs; a
  resumed request prefills its prompt and its tokens so far again (its KV cache went with the abort).
- **Batch**: 64 prompts × 8 samples = 512 samples per step, one sample per engine slot.
- **Trainer**: 2 s + 15 µs per token (prompt + response) per step: log-prob passes, forward and backward of
  ~1.7M tokens ≈ 27 s, about 35% MFU for 7B on 8 H100-class GPUs.
- **Weight sync**: 5 s, during which the engines serve nothing.

Two more workloads (`WORKLOADS`, `bench/async_vs_sync.py --workload`):

- **bimodal**: 90% short answers (median 768 tokens, σ 0.25) and a 10% tail twenty times longer (median
  15,360), the held-out case of the in-flight issue: the tail outlives any small staleness bound.
- **agent**: a multi-turn agent's late turns: the context the trajectory has reached (median 16,384 tokens,
  σ 0.4, up to 32,768) and a turn's answer (median 1,024, σ 0.8, cap 8,192). Every request carries the whole
  context, so a drained sync, whose resumed requests prefill it again, pays most there. Its trainer is 5x the
  default's per token (3 µs: ~40 training GPUs), so that generation, not training 16k-token contexts, bounds it.

Every sample's length is a pure function of (seed, sample index, attempt), so two schedules see the same
samples and a run is reproducible; a group regenerated after a staleness retry draws new lengths.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(high, max(low, round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))))


@dataclass(frozen=True)
class Workload:
    seed: int = 0
    # responses
    response_median: float = 2048.0
    response_sigma: float = 0.8
    response_min: int = 16
    max_new_tokens: int = 16384
    tail_fraction: float = 0.0  # this share of answers draws its median `tail_factor` times longer
    tail_factor: float = 20.0
    # prompts
    prompt_median: float = 512.0
    prompt_sigma: float = 0.3
    prompt_min: int = 64
    prompt_max: int = 2048
    # engines
    engines: int = 8
    slots_per_engine: int = 64
    decode_step_s: float = 0.018
    decode_step_per_request_s: float = 0.0002
    prefill_per_token_s: float = 0.00002
    # batch
    rollout_batch_size: int = 64
    n_samples_per_prompt: int = 8
    # trainer and weight sync
    train_step_s: float = 2.0
    train_per_token_s: float = 0.000015
    weight_sync_s: float = 5.0

    def response_length(self, index: int, attempt: int = 0) -> int:
        """The length sample `index` wants on its `attempt`-th generation (retries draw anew)."""
        rng = random.Random(f"response:{self.seed}:{index}:{attempt}")
        median = self.response_median
        if self.tail_fraction and rng.random() < self.tail_fraction:
            median *= self.tail_factor
        return _lognormal(rng, median, self.response_sigma, self.response_min, self.max_new_tokens)

    def prompt_length(self, group_index: int) -> int:
        rng = random.Random(f"prompt:{self.seed}:{group_index}")
        return _lognormal(rng, self.prompt_median, self.prompt_sigma, self.prompt_min, self.prompt_max)

    def decode_step(self, running: int) -> float:
        return self.decode_step_s + self.decode_step_per_request_s * running

    def train_time(self, tokens: int) -> float:
        return self.train_step_s + self.train_per_token_s * tokens

    def replace(self, **changes: Any) -> Workload:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


DEFAULT = Workload()
WORKLOADS = {
    "long_tail": DEFAULT,
    "bimodal": Workload(response_median=768.0, response_sigma=0.25, tail_fraction=0.1, max_new_tokens=32768),
    "agent": Workload(
        response_median=1024.0,
        max_new_tokens=8192,
        prompt_median=16384.0,
        prompt_sigma=0.4,
        prompt_max=32768,
        train_per_token_s=0.000003,
    ),
}
