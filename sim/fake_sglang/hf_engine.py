"""`hf` engine: a real transformers causal LM decoding the running batch one token per step.

Why full recompute instead of a KV cache: requests join and leave the batch at every step (continuous
batching); recomputing the left-padded batch keeps the code obviously correct, and the tiny CPU models the
fake serves make it cheap. Log-probs are SGLang's (see sampling.py), so the trainer can check them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch

from sim.fake_sglang.engine import Engine
from sim.fake_sglang.protocol import BadRequest, GenRequest
from sim.fake_sglang.sampling import sample_one

logger = logging.getLogger(__name__)


def load_model(model_path: str, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return model.to(device).eval()


class HFEngine(Engine):
    name = "hf"

    def __init__(self, *, model_path: str, device: str = "cpu", **kw: Any) -> None:
        from transformers import AutoTokenizer

        super().__init__(tokenizer=AutoTokenizer.from_pretrained(model_path), **kw)
        self.device = device
        self.model = load_model(model_path, device)
        self._eos = self._collect_eos(self.model, self.tokenizer)

    @staticmethod
    def _collect_eos(model: Any, tokenizer: Any) -> set[int]:
        # SGLang stops on the model config's / generation config's eos ids plus the tokenizer's eos
        # (python/sglang/srt/configs/model_config.py: hf_eos_token_id; schedule_batch.py eos_token_ids).
        ids: set[int] = set()
        for src in (model.config.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif src:
                ids.update(int(i) for i in src)
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        return ids

    def eos_token_ids(self) -> set[int]:
        return self._eos

    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @torch.no_grad()
    def _forward_last_logits(self, seqs: list[list[int]]) -> torch.Tensor:
        """Logits of the last position of each sequence, batch left-padded with explicit positions."""
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=pos.to(self.device),
            use_cache=False,
        )
        return out.logits[:, -1, :].float().cpu()

    def _step_sync(self, batch: list[GenRequest]) -> list[tuple[int, float]]:
        logits = self._forward_last_logits([r.prompt_ids + r.output_ids for r in batch])
        out = []
        for i, r in enumerate(batch):
            p = r.params
            out.append(
                sample_one(
                    logits[i],
                    temperature=p.temperature,
                    top_p=p.top_p,
                    top_k=p.top_k,
                    min_p=p.min_p,
                    generator=r.generator,
                )
            )
        return out

    async def step(self, batch: list[GenRequest]) -> list[tuple[int, float]]:
        return await asyncio.to_thread(self._step_sync, batch)

    async def load_named_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        params = self.model.state_dict(keep_vars=True)
        unknown = [n for n, _ in named if n not in params]
        if unknown:
            raise BadRequest(f"unknown parameter names: {unknown[:5]}{'...' if len(unknown) > 5 else ''}")
        for n, t in named:
            if tuple(t.shape) != tuple(params[n].shape):
                raise BadRequest(f"shape mismatch for {n}: got {tuple(t.shape)}, want {tuple(params[n].shape)}")
        async with self.step_lock:
            with torch.no_grad():
                for n, t in named:
                    params[n].data.copy_(t.to(device=params[n].device, dtype=params[n].dtype))

    async def load_from_disk(self, model_path: str) -> None:
        model = await asyncio.to_thread(load_model, model_path, self.device)
        if model.config.vocab_size != self.model.config.vocab_size:
            raise BadRequest("update_weights_from_disk: vocabulary size differs from the served model")
        async with self.step_lock:
            self.model = model
