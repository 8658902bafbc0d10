"""`hf` engine: a real transformers causal LM decoding the running batch one token per step.

Requests join and leave the batch at every step (continuous batching), so the KV cache is kept per batch row
and keyed by request id: rows of finished or aborted requests are dropped, joining requests are prefilled on
their own and left-padded into the batch, and a weight update drops the whole cache (SGLang flushes it too).
Without it every step recomputed every sequence, which made rollouts on CPU several times slower than the
trainer. Models whose cache is not a plain per-layer key/value cache fall back to that full recompute.
Log-probs are SGLang's (see sampling.py), so the trainer can check them.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch

from sim.fake_sglang.engine import Engine, ScoredPrompt, StepResult
from sim.fake_sglang.hf_names import checkpoint_named_tensors
from sim.fake_sglang.protocol import BadRequest, GenRequest
from sim.fake_sglang.sampling import logprob_temperature, sample_batch
from sim.fake_sglang.weights import Received

logger = logging.getLogger(__name__)

_COPY_ALONE = 1 << 20  # elements: a tensor this large is copied by a `copy_` of its own when weights arrive


def load_model(model_path: str, device: str, dtype: str = "float32") -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    return model.to(device).eval()


@dataclass
class _BatchKV:
    """Key/value cache of the running batch: row i belongs to `rids[i]` and holds its first `held[i]` tokens."""

    rids: list[str]
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), [rows, kv_heads, width, head_dim]
    mask: torch.Tensor  # [rows, width], 1 where a token is held (left padding is 0)
    held: list[int]

    def select(self, rows: list[int]) -> _BatchKV:
        idx = torch.tensor(rows, device=self.mask.device)
        mask = self.mask[idx]
        keep = int(mask.sum(0).nonzero()[0]) if bool(mask.any()) else mask.size(1)  # drop all-padding columns
        layers = [(k[idx, :, keep:], v[idx, :, keep:]) for k, v in self.layers]
        return _BatchKV([self.rids[i] for i in rows], layers, mask[:, keep:], [self.held[i] for i in rows])

    @staticmethod
    def concat(parts: list[_BatchKV]) -> _BatchKV:
        width = max(p.mask.size(1) for p in parts)

        def left_pad(x: torch.Tensor, dim: int) -> torch.Tensor:
            pad = [0, 0] * (x.dim() - 1 - dim) + [width - x.size(dim), 0]
            return torch.nn.functional.pad(x, pad)

        layers = [
            (
                torch.cat([left_pad(p.layers[i][0], 2) for p in parts]),
                torch.cat([left_pad(p.layers[i][1], 2) for p in parts]),
            )
            for i in range(len(parts[0].layers))
        ]
        mask = torch.cat([left_pad(p.mask, 1) for p in parts])
        return _BatchKV([r for p in parts for r in p.rids], layers, mask, [h for p in parts for h in p.held])


class HFEngine(Engine):
    name = "hf"

    def __init__(self, *, model_path: str, device: str = "cpu", dtype: str = "float32", **kw: Any) -> None:
        from transformers import AutoTokenizer

        super().__init__(tokenizer=AutoTokenizer.from_pretrained(model_path), **kw)
        self.device = device
        self.dtype = dtype  # the weights' storage dtype: a bf16 trainer's synced weights land bit-exact
        self.model = load_model(model_path, device, dtype)
        self._eos = self._collect_eos(self.model, self.tokenizer)
        self.kv_cache = True  # off after a model whose cache layout this engine does not know
        self._kv: _BatchKV | None = None
        self._params: tuple[Any, dict[str, tuple[tuple[int, ...], torch.Tensor]]] | None = None  # per model
        # transformers 5.24 renamed `past_key_values` to `cache` (in and out); GPU hosts may carry an older one.
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

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

    @staticmethod
    def _left_pad(seqs: list[list[int]] | list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
        return ids, mask

    @torch.no_grad()
    def _prefill(self, rids: list[str], seqs: list[list[int]]) -> tuple[torch.Tensor, _BatchKV | None]:
        """Last-position logits of each whole sequence (batch left-padded, explicit positions), plus its cache.

        Identical sequences (the n samples of one prompt arrive together) are computed once and their rows
        repeated, as SGLang's radix cache shares a common prompt.
        """
        unique: dict[tuple[int, ...], int] = {}
        row = [unique.setdefault(tuple(s), len(unique)) for s in seqs]
        ids, mask = (x.to(self.device) for x in self._left_pad(list(unique)))
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=self.kv_cache)
        layers = self._plain_layers(getattr(out, self._cache_kw)) if self.kv_cache else None
        logits = out.logits[:, -1, :]
        if len(unique) < len(seqs):
            idx = torch.tensor(row, device=mask.device)
            logits, mask = logits[idx], mask[idx]
            layers = [(k[idx], v[idx]) for k, v in layers] if layers is not None else None
        kv = _BatchKV(rids, layers, mask, [len(s) for s in seqs]) if layers is not None else None
        return logits.float().cpu(), kv

    @torch.no_grad()
    def _decode(self, kv: _BatchKV, last_tokens: list[int]) -> tuple[torch.Tensor, _BatchKV | None]:
        from transformers import DynamicCache

        ids = torch.tensor(last_tokens, dtype=torch.long, device=self.device)[:, None]
        pos = kv.mask.sum(-1, keepdim=True)  # positions count each row's own tokens, not its padding
        mask = torch.cat([kv.mask, torch.ones_like(kv.mask[:, :1])], 1)
        kw = {self._cache_kw: DynamicCache(ddp_cache_data=kv.layers)}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **kw)
        layers = self._plain_layers(getattr(out, self._cache_kw))
        new = _BatchKV(kv.rids, layers, mask, [h + 1 for h in kv.held]) if layers is not None else None
        return out.logits[:, -1, :].float().cpu(), new

    def _plain_layers(self, cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        from transformers.cache_utils import DynamicLayer

        layers = getattr(cache, "layers", None)
        if not layers or any(type(la) is not DynamicLayer for la in layers):  # subclasses (sliding) differ
            logger.warning("hf engine: %s cache is not plain key/value; recomputing every step", type(cache))
            self.kv_cache = False
            return None
        return [(la.keys, la.values) for la in layers]

    def _batch_logits(self, batch: list[GenRequest]) -> torch.Tensor:
        """Next-token logits of every request: cached rows decode one token, the others are prefilled."""
        seqs = [r.prompt_ids + r.output_ids for r in batch]
        if not self.kv_cache:
            return self._prefill([r.rid for r in batch], seqs)[0]
        kv, self._kv = self._kv, None  # rebuilt below; a failing step leaves no half-updated cache
        row = {rid: i for i, rid in enumerate(kv.rids)} if kv is not None else {}
        cached = [i for i, r in enumerate(batch) if r.rid in row and kv.held[row[r.rid]] == len(seqs[i]) - 1]
        fresh = sorted(set(range(len(batch))) - set(cached))
        logits = torch.empty(len(batch), self.vocab_size())
        parts: list[_BatchKV | None] = []
        if cached:
            lg, part = self._decode(kv.select([row[batch[i].rid] for i in cached]), [seqs[i][-1] for i in cached])
            logits[cached] = lg
            parts.append(part)
        if fresh:
            lg, part = self._prefill([batch[i].rid for i in fresh], [seqs[i] for i in fresh])
            logits[fresh] = lg
            parts.append(part)
        if self.kv_cache and all(p is not None for p in parts):
            self._kv = _BatchKV.concat(parts)
        return logits

    def _step_sync(self, batch: list[GenRequest]) -> list[StepResult]:
        logits = self._batch_logits(batch)
        params = [(r.params.temperature, r.params.top_p, r.params.top_k, r.params.min_p) for r in batch]
        out: list[StepResult] = list(sample_batch(logits, params, [r.generator for r in batch]))
        for i, r in enumerate(batch):
            if r.top_logprobs_num > 0:  # the top-k of the distribution the log-probs are read from (sampling.py)
                lps = torch.log_softmax(logits[i].float() / logprob_temperature(r.params.temperature), dim=-1)
                best = torch.topk(lps, min(r.top_logprobs_num, lps.numel()))
                out[i] = (*out[i], list(zip(best.values.tolist(), best.indices.tolist(), strict=True)))
        return out

    async def step(self, batch: list[GenRequest]) -> list[StepResult]:
        return await asyncio.to_thread(self._step_sync, batch)

    @torch.no_grad()
    def score_prompt(self, prompt_ids: list[int], start: int, temperature: float, top_k: int) -> ScoredPrompt:
        """One teacher-forced forward of the prompt (its own row: no padding, no cache), fp32 log-softmax of the
        logits at positions start..n-2 divided by `temperature`, read at the tokens that follow them."""
        if start + 1 >= len(prompt_ids):
            return [], ([] if top_k > 0 else None)
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        logits = self.model(input_ids=ids).logits[0, start:-1].float().cpu()
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        target = torch.tensor(prompt_ids[start + 1 :], dtype=torch.long)
        lps = logprobs.gather(-1, target[:, None])[:, 0].tolist()
        if top_k <= 0:
            return lps, None
        best = torch.topk(logprobs, min(top_k, logprobs.size(-1)), dim=-1)
        tops = [list(zip(v, i, strict=True)) for v, i in zip(best.values.tolist(), best.indices.tolist(), strict=True)]
        return lps, tops

    async def _score_prompt_async(self, prompt_ids: list[int], start: int, temperature: float, top_k: int):
        return await asyncio.to_thread(self.score_prompt, prompt_ids, start, temperature, top_k)

    def _params_by_name(self) -> dict[str, tuple[tuple[int, ...], torch.Tensor]]:
        """The served model's tensors by HF name, as (shape, a 1-D view of the tensor), built once per model: a
        weight sync looks up every one, and copies a bucket's 1-D slices straight into these views."""
        if self._params is None or self._params[0] is not self.model:
            named = checkpoint_named_tensors(list(self.model.state_dict(keep_vars=True).items()))
            # MoE experts per expert; a view that is not contiguous (none in the HF models served) stays in shape
            by_name = {n: (tuple(t.shape), t.data.view(-1) if t.is_contiguous() else t.data) for n, t in named}
            self._params = (self.model, by_name)
        return self._params[1]

    async def load_named_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        shapes = [tuple(t.shape) for _, t in named]
        await self.load_received(Received([n for n, _ in named], shapes, [t for _, t in named]))

    async def load_received(self, received: Received) -> None:
        """Copy each tensor into its parameter before answering: the tensors may be views of the sender's memory
        (weights.decode), which it reuses once answered, so on CUDA the copies are complete before we return.

        Large tensors are copied one `copy_` each, the small ones in one grouped `_foreach_copy_`: the grouped
        kernel moves large tensors at ~2/3 of a plain copy's speed, and a launch per small tensor costs more than
        its bytes (3.07 GB in 218 tensors on an H200: 2.27 ms grouped, 2.03 ms one by one, 1.47 ms as one flat
        copy; `bench/gpu_ipc_parts.py`)."""
        params = self._params_by_name()
        names, shapes, tensors = received
        unknown = [n for n in names if n not in params]
        if unknown:
            raise BadRequest(f"unknown parameter names: {unknown[:5]}{'...' if len(unknown) > 5 else ''}")
        dst = [params[n] for n in names]
        for n, shape, (want, _) in zip(names, shapes, dst, strict=True):
            if shape != want:
                raise BadRequest(f"shape mismatch for {n}: got {shape}, want {want}")
        async with self.step_lock:
            self._kv = None  # keys/values of the old weights
            small_dst, small_src = [], []
            with torch.no_grad():
                for (_, d), t in zip(dst, tensors, strict=True):
                    t = t if t.shape == d.shape else t.reshape(d.shape)
                    if t.numel() >= _COPY_ALONE or t.dtype != d.dtype or t.device != d.device:
                        d.copy_(t, non_blocking=True)  # copy_ casts dtype and moves device itself
                    else:
                        small_dst.append(d)
                        small_src.append(t)
                if small_dst:
                    torch._foreach_copy_(small_dst, small_src)  # one grouped launch for the many small ones
            if torch.device(self.device).type == "cuda":
                torch.cuda.synchronize(self.device)

    async def load_from_disk(self, model_path: str) -> None:
        model = await asyncio.to_thread(load_model, model_path, self.device, self.dtype)
        if model.config.vocab_size != self.model.config.vocab_size:
            raise BadRequest("update_weights_from_disk: vocabulary size differs from the served model")
        async with self.step_lock:
            self._kv = None
            self.model = model
