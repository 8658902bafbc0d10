"""`scripted` engine: answers chosen by regex rules on the decoded prompt, for driving agents and rollouts.

Why: agent / multi-turn / reward tests need a policy whose answers are known (a tool call here, a final
answer there) while everything else — tokenization, finish reasons, log-prob alignment, abort, pause —
behaves like a real engine.

Script format (YAML or JSON), passed with ``--script FILE``::

    rules:                              # ordered; the first rule whose regex matches wins
      - match: "What is 2\\+2"          # Python `re.search` on the prompt decoded WITH special tokens
        completion: "<think>\\nadd\\n</think>\\n\\n4"
        finish_reason: stop             # stop (default): append the tokenizer's EOS (<|im_end|>) after
                                        # the completion; length: end without EOS, finish type "length"
      - match: "weather"
        completions:                    # alternative to `completion`: one picked per request with the
          - '<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>'
          - "I do not know."            # request's generator (so `sampling_seed` fixes the choice)
    default:                            # used when no rule matches (optional; default completion "")
      completion: "I cannot help with that."
      finish_reason: stop
    token_latency_s: 0.0                # optional sleep per decode step (makes abort / pause observable)

The completion is tokenized with the served model's tokenizer (``--model-path`` is required) and emitted one
token per step, so `max_new_tokens` truncates it (finish "length") and stop strings / stop_token_ids apply
as for a real model. Log-probs are deterministic, strictly negative and depend on (token id, position):
``logprob(t, i) = -(0.05 + ((31 * t + 17 * i) % 97) / 100)``, so an off-by-one in log-prob alignment shows.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import torch
import yaml

from sim.fake_sglang.engine import Engine
from sim.fake_sglang.protocol import GenRequest, finish_length
from sim.fake_sglang.sampling import scripted_logprob

__all__ = ["ScriptedEngine", "load_script", "scripted_logprob"]


def load_script(path: str | Path) -> dict[str, Any]:
    text = Path(path).read_text()
    data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: script must be a mapping with `rules` and optional `default`")
    rules = data.get("rules") or []
    for i, rule in enumerate(rules):
        if "match" not in rule or ("completion" not in rule and "completions" not in rule):
            raise ValueError(f"{path}: rules[{i}] needs `match` and `completion` (or `completions`)")
        if rule.get("finish_reason", "stop") not in ("stop", "length"):
            raise ValueError(f"{path}: rules[{i}].finish_reason must be stop or length")
        re.compile(rule["match"])
    return data


class ScriptedEngine(Engine):
    name = "scripted"

    def __init__(self, *, model_path: str, script: dict[str, Any], **kw: Any) -> None:
        from transformers import AutoTokenizer

        super().__init__(tokenizer=AutoTokenizer.from_pretrained(model_path), **kw)
        self.script = script
        self.rules = [(re.compile(r["match"]), r) for r in script.get("rules") or []]
        self.default = script.get("default") or {"completion": "", "finish_reason": "stop"}
        self.token_latency_s = float(script.get("token_latency_s", 0.0))
        self._eos = int(self.tokenizer.eos_token_id)

    def eos_token_ids(self) -> set[int]:
        return {self._eos}

    def pick_rule(self, prompt_text: str) -> dict[str, Any]:
        for rx, rule in self.rules:
            if rx.search(prompt_text):
                return rule
        return self.default

    def prepare(self, req: GenRequest) -> None:
        prompt_text = self.decode(req.prompt_ids, skip_special_tokens=False)
        rule = self.pick_rule(prompt_text)
        if "completions" in rule:
            options = list(rule["completions"])
            text = options[int(torch.randint(len(options), (1,), generator=req.generator))]
        else:
            text = rule.get("completion", "")
        tokens = self.encode(text)
        if rule.get("finish_reason", "stop") == "stop" or not tokens:
            tokens.append(self._eos)
        req.engine_state["script_tokens"] = tokens

    async def step(self, batch: list[GenRequest]) -> list[tuple[int, float]]:
        await asyncio.sleep(self.token_latency_s)
        out = []
        for r in batch:
            tokens = r.engine_state["script_tokens"]
            i = len(r.output_ids)
            out.append((tokens[i], scripted_logprob(tokens[i], i)))
            if i + 1 == len(tokens) and (tokens[-1] != self._eos or r.params.ignore_eos):
                # Script exhausted without EOS: end like a model that hit its own length limit.
                r.engine_state["end_after_step"] = True
        return out

    def _check_finished(self, req: GenRequest) -> None:
        super()._check_finished(req)
        if not req.finished and req.engine_state.pop("end_after_step", False):
            req.finish(finish_length(len(req.output_ids)))
