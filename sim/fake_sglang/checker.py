"""`/weights_checker` of the fake server, mirroring SGLang 0.5.23's endpoint of that name.

Why: the trainer must be able to prove that an engine serves exactly the weights it pushed. SGLang 0.5.23 has
an endpoint for this (python/sglang/srt/entrypoints/http_server.py: `check_weights`, GET/POST
`/weights_checker`, body `CheckWeightsReqInput` of python/sglang/srt/managers/io_struct.py), whose per-rank
work is python/sglang/srt/utils/weight_checker.py `WeightChecker.handle`. Actions:

- ``checksum`` (default): per tensor of ``named_parameters()`` then ``named_buffers()`` (non-persistent RoPE
  caches and ``skip_tensor_list`` substrings excluded), ``f"{tensor_hash(t):016x}"`` where ``tensor_hash`` is
  the first 8 bytes of SHA-256 over the tensor's raw bytes, big-endian (python/sglang/srt/managers/mm_utils.py,
  CPU path); ``per_gpu_checksum`` = SHA-256 over the sorted (name, checksum) pairs; the answer's
  ``per_engine_checksum`` = SHA-256 over the ranks' ``per_gpu_checksum`` strings (tokenizer_control_mixin.py).
- ``snapshot`` / ``reset_tensors`` / ``compare``: keep a copy, overwrite every checked tensor with random
  values, and later require the current weights to equal the copy (a weight update must rewrite everything).

Answer: ``{"success", "message"}`` plus, for ``checksum``, ``ranks`` (one ``ChecksumInfo`` per TP rank:
``checksums``, ``per_gpu_checksum``, ``parallelism_info``) and ``per_engine_checksum``; HTTP 400 on failure.

The fake differs in two ways that matter to a reader comparing hashes: its parameter names are the HF ones
(the `hf` engine is a transformers model), whereas real SGLang fuses ``qkv_proj`` / ``gate_up_proj`` and
hashes CUDA tensors with a GPU kernel; the trainer-side twin (`slime.backends.megatron.weight_hash`) therefore
matches the fake and SGLang's CPU path, not a GPU SGLang's per-tensor values. Engines without weights
(scripted, synthetic) answer ``success: false``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

import torch
from aiohttp import web

from sim.fake_sglang.hf_names import checkpoint_named_tensors
from sim.fake_sglang.validation import CHECK_WEIGHTS, RequestError, read_body

logger = logging.getLogger(__name__)

ACTIONS = ("checksum", "snapshot", "reset_tensors", "compare")
# weight_checker.py: _NON_PERSISTENT_BUFFER_PATTERNS (derived from shapes, never synced)
NON_PERSISTENT_PATTERNS = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu")


# The two hashes below are written from SGLang's source, not imported from the trainer-side twin
# (slime.backends.megatron.weight_hash): the fake plays the engine, so agreement between the two is a check.
def tensor_checksum(t: torch.Tensor) -> str:
    """SGLang's `tensor_hash` as 16 hex digits: for a CPU tensor SHA-256 of the raw bytes, first 8 bytes, big-endian;
    a CUDA tensor goes through SGLang's GPU kernel's hash (managers/mm_utils.py), here its torch port."""
    if t.is_cuda:
        from slime.backends.megatron.gpu_tensor_hash import gpu_tensor_checksum

        return gpu_tensor_checksum(t)
    t = t.detach().to("cpu").contiguous()
    digest = hashlib.sha256(memoryview(t.reshape(-1).view(torch.uint8).numpy())).digest()[:8]
    return f"{int.from_bytes(digest, 'big'):016x}"


def overall_checksum(checksums: dict[str, str]) -> str:
    """weight_checker.py `overall_checksum`: SHA-256 over the sorted (name, checksum) pairs."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def engine_checksum(per_gpu_checksums: list[str]) -> str:
    """tokenizer_control_mixin.py `check_weights`: SHA-256 over the ranks' per-GPU checksums, in rank order."""
    h = hashlib.sha256()
    for c in per_gpu_checksums:
        h.update(c.encode())
    return h.hexdigest()


def _skipped(name: str, skip: list[str] | None) -> bool:
    return any(p in name for p in NON_PERSISTENT_PATTERNS) or any(p in name for p in (skip or ()))


def model_state(model: torch.nn.Module, skip: list[str] | None = None) -> list[tuple[str, torch.Tensor]]:
    """Parameters then buffers, as weight_checker.py `_model_state` walks them (shared tensors listed once); MoE
    experts under their per-expert checkpoint names (hf_names.py), the names a trainer's checksums use."""
    items = checkpoint_named_tensors(list(model.named_parameters())) + list(model.named_buffers())
    return [(n, t) for n, t in items if not _skipped(n, skip)]


class WeightChecker:
    """Per-engine state of the snapshot/compare actions; `handle` runs synchronously (call it in a thread)."""

    def __init__(self, model_getter: Any, role: bool = True) -> None:
        self._get_model = model_getter
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._role = role

    def handle(self, action: str, skip: list[str] | None) -> dict[str, Any] | None:
        model = self._get_model()
        if action == "checksum":
            sums = {n: tensor_checksum(t) for n, t in model_state(model, skip)}
            info = {"tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1, "rank": 0,
                    "size": 1}  # fmt: skip
            return {
                "checksums": sums,
                "per_gpu_checksum": overall_checksum(sums),
                "parallelism_info": {"role": "target", **info} if self._role else info,
            }
        if action == "snapshot":
            self._snapshot = {n: t.detach().clone() for n, t in model_state(model, skip)}
            return None
        if action == "reset_tensors":
            with torch.no_grad():
                for _, t in model_state(model, skip):
                    t.copy_(torch.rand_like(t) if t.is_floating_point() else torch.zeros_like(t))
            return None
        if self._snapshot is None:
            raise ValueError("compare needs a snapshot first (action=snapshot)")
        bad = []
        for n, t in model_state(model, skip):
            want = self._snapshot.get(n)
            if want is None or not torch.equal(want, t.detach()):
                bad.append(n)
        if bad:  # the snapshot stays, as in SGLang: update again and compare again
            raise ValueError(f"check tensor equality failed for {len(bad)} tensors: {bad[:5]}")
        self._snapshot = None
        return None


def register_weights_checker(app: web.Application, engine: Any, skip_list: bool = True) -> None:
    """Add GET/POST `/weights_checker` to the fake server's app (weights read under the engine's step lock).
    `skip_list` False: a release before 0.5.21, whose checker ignores `skip_tensor_list` and reports no `role`."""
    checker = WeightChecker(lambda: engine.model, role=skip_list)

    async def weights_checker(request: web.Request) -> web.Response:
        # http_server.py check_weights: an optional CheckWeightsReqInput body, validated like every other one
        try:
            raw = await read_body(request)
            body = CHECK_WEIGHTS.validate(raw, required=False) or CHECK_WEIGHTS.validate({})
        except RequestError as e:  # handled here: the checker also serves apps without the server's middleware
            return e.response
        request["log"]["body"] = raw if isinstance(raw, dict) else {}
        action = body["action"]
        if action not in ACTIONS:
            return web.json_response({"success": False, "message": f"Unsupported action={action!r}"}, status=400)
        if engine.model is None:
            msg = f"the {engine.name} engine holds no weights"
            return web.json_response({"success": False, "message": msg}, status=400)
        try:
            async with engine.step_lock:  # never hash half of an update or a running step
                skip = body["skip_tensor_list"] if skip_list else None
                info = await asyncio.to_thread(checker.handle, action, skip)
        except ValueError as e:
            logger.warning("weights_checker %s failed: %s", action, e)
            return web.json_response({"success": False, "message": str(e)}, status=400)
        out: dict[str, Any] = {"success": True, "message": "Success."}
        if info is not None:
            out["ranks"] = [info]
            out["per_engine_checksum"] = engine_checksum([info["per_gpu_checksum"]])
            request["log"]["per_engine_checksum"] = out["per_engine_checksum"]
        return web.json_response(out)

    app.router.add_get("/weights_checker", weights_checker)  # http_server.py: GET and POST
    app.router.add_post("/weights_checker", weights_checker)
