"""`synthetic` engine: no model; response lengths and decode-step latency drawn from seeded distributions.

Why: scheduling experiments (partial rollout, fully async, over-sampling, abort) need long-tailed response
lengths and realistic step times at scale, not a model.

Config (YAML or JSON), passed with ``--synthetic-config FILE``; every field optional::

    vocab_size: 512               # token ids are drawn uniformly from [1, vocab_size); 0 is the EOS id
    eos_token_id: 0
    output_len:                   # per request, from the request's generator (sampling_seed or server seed)
      dist: lognormal             # fixed (value) | uniform (low, high) | lognormal (mu, sigma) | normal (mean, std)
      mu: 4.0
      sigma: 1.0
      min: 1                      # optional clipping
      max: 4096
    token_latency_s:              # per decode step (the whole running batch advances one token per step),
      dist: fixed                 # drawn from the server's generator seeded by --random-seed
      value: 0.001
    latency_per_running_request_s: 0.0   # optional extra step time per running request (batch-size cost)

A request whose drawn length is below `max_new_tokens` ends with the EOS id (finish "stop"); otherwise it
is cut at `max_new_tokens` (finish "length"). Log-probs are drawn in [-3, -0.01).
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import torch
import yaml

from sim.fake_sglang.engine import Engine
from sim.fake_sglang.protocol import GenRequest

DEFAULT_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "eos_token_id": 0,
    "output_len": {"dist": "lognormal", "mu": 4.0, "sigma": 1.0, "min": 1},
    "token_latency_s": {"dist": "fixed", "value": 0.0},
    "latency_per_running_request_s": 0.0,
}


def draw(spec: dict[str, Any] | float | int, gen: torch.Generator) -> float:
    """One draw from a distribution spec (see module docstring), using `gen` only."""
    if isinstance(spec, int | float):
        return float(spec)
    kind = spec.get("dist", "fixed")
    u = float(torch.rand((), generator=gen, dtype=torch.float64))
    if kind == "fixed":
        x = float(spec["value"])
    elif kind == "uniform":
        x = float(spec["low"]) + u * (float(spec["high"]) - float(spec["low"]))
    elif kind in ("lognormal", "normal"):
        # Box-Muller from two uniforms of the same generator keeps draws reproducible across torch versions.
        u2 = float(torch.rand((), generator=gen, dtype=torch.float64))
        z = math.sqrt(-2.0 * math.log(max(u, 1e-300))) * math.cos(2 * math.pi * u2)
        if kind == "lognormal":
            x = math.exp(float(spec.get("mu", 0.0)) + float(spec.get("sigma", 1.0)) * z)
        else:
            x = float(spec.get("mean", 0.0)) + float(spec.get("std", 1.0)) * z
    else:
        raise ValueError(f"unknown dist {kind!r}; expected fixed, uniform, lognormal or normal")
    if "min" in spec:
        x = max(x, float(spec["min"]))
    if "max" in spec:
        x = min(x, float(spec["max"]))
    return x


def load_config(path: str | Path | None) -> dict[str, Any]:
    cfg = dict(DEFAULT_CONFIG)
    if path:
        text = Path(path).read_text()
        cfg.update((json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)) or {})
    return cfg


class SyntheticEngine(Engine):
    name = "synthetic"

    def __init__(self, *, config: dict[str, Any], **kw: Any) -> None:
        super().__init__(tokenizer=None, **kw)
        self.config = config
        self._vocab = int(config["vocab_size"])
        self._eos = int(config["eos_token_id"])
        self._latency_gen = torch.Generator().manual_seed(self.random_seed)

    def vocab_size(self) -> int:
        return self._vocab

    def eos_token_ids(self) -> set[int]:
        return {self._eos}

    def prepare(self, req: GenRequest) -> None:
        req.engine_state["target_len"] = max(1, int(round(draw(self.config["output_len"], req.generator))))

    async def step(self, batch: list[GenRequest]) -> list[tuple[int, float]]:
        delay = draw(self.config["token_latency_s"], self._latency_gen)
        delay += float(self.config.get("latency_per_running_request_s", 0.0)) * len(batch)
        await asyncio.sleep(max(0.0, delay))
        out = []
        for r in batch:
            if len(r.output_ids) + 1 >= r.engine_state["target_len"]:
                tok = self._eos
            else:
                tok = int(torch.randint(1, self._vocab, (1,), generator=r.generator))
                if tok == self._eos:
                    tok = (tok % (self._vocab - 1)) + 1
            lp = -0.01 - 2.99 * float(torch.rand((), generator=r.generator))
            out.append((tok, lp))
        return out
