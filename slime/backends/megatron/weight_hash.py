"""Hashes of the HF weights the trainer exports, in the format of SGLang's `/weights_checker` checksums.

Why: after a weight sync the trainer and each engine should hold bit-identical weights. Comparing hashes
proves it without shipping the weights back. The format is SGLang 0.5.23's (python/sglang/srt/utils/
weight_checker.py `_compute_checksum`): per tensor ``f"{tensor_hash(t):016x}"``, where ``tensor_hash`` of a CPU
tensor is the first 8 bytes of SHA-256 over its raw bytes read big-endian (python/sglang/srt/managers/
mm_utils.py); the per-rank checksum is SHA-256 over the sorted (name, checksum) pairs.

What can be compared with what: the engine says (`ChecksumLayout`). The simulated engine names
tensors as the HF checkpoint does; SGLang names its fused parameters (``qkv_proj`` = q, k, v stacked; ``gate_up_proj``
= gate, up), so the trainer fuses before hashing (`fused_hf_tensors`, engine TP 1). Tensors on a GPU are hashed by
SGLang with a GPU kernel instead of SHA-256 (`gpu_tensor_hash.py`, a port checked against that kernel), so the
trainer hashes them that way for such an engine.

Use (the `--check-weight-update-equal` wiring)::

    check_trainer_on_engines(trainer, engine_urls)  # a collective of every train rank; rank 0 asks each engine
                                                    # once, hashes as it does, raises WeightMismatch naming tensors

With pipeline parallelism each stage's sender hashes its own layers; merge the dicts (names are disjoint)
before comparing with an engine, which holds all layers.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from slime.backends.megatron.gpu_tensor_hash import gpu_tensor_checksum
from slime.backends.sglang.client import SGLangClient, SGLangError

logger = logging.getLogger(__name__)

# weight_checker.py: _NON_PERSISTENT_BUFFER_PATTERNS — engines skip these, the trainer never exports them
_SKIPPED = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu")


class WeightMismatch(RuntimeError):
    """An engine does not hold the weights the trainer just sent."""


@dataclass(frozen=True)
class ChecksumLayout:
    """How an engine's `/weights_checker` names and hashes its tensors."""

    fused: bool = False  # SGLang's parameter names (qkv_proj, gate_up_proj), not the HF checkpoint's
    gpu_hash: bool = False  # tensors on a GPU, hashed by SGLang's GPU kernel rather than SHA-256


HF_LAYOUT = ChecksumLayout()

# SGLang's stacked_params_mapping for the dense decoders slime trains (python/sglang/srt/models/qwen2.py,
# llama.py, qwen3.py): HF suffix -> (fused suffix, position among the stacked parts)
_FUSED = {
    ".q_proj.": (".qkv_proj.", 0, 3),
    ".k_proj.": (".qkv_proj.", 1, 3),
    ".v_proj.": (".qkv_proj.", 2, 3),
    ".gate_proj.": (".gate_up_proj.", 0, 2),
    ".up_proj.": (".gate_up_proj.", 1, 2),
}


def fused_hf_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors as a TP-1 SGLang engine holds them: q/k/v and gate/up stacked along dim 0 under the fused
    name, everything else as it is. Parts are held only until their fused tensor is complete."""
    pending: dict[str, list[torch.Tensor | None]] = {}
    for name, t in named:
        hit = next(((hf, spec) for hf, spec in _FUSED.items() if hf in name), None)
        if hit is None:
            yield name, t
            continue
        hf, (fused, index, parts) = hit
        key = name.replace(hf, fused)
        slots = pending.setdefault(key, [None] * parts)
        slots[index] = t
        if all(p is not None for p in slots):
            yield key, torch.cat(pending.pop(key), dim=0)  # type: ignore[arg-type]
    if pending:
        raise ValueError(f"fused tensors with parts missing: {sorted(pending)[:5]}")


def tensor_checksum(t: torch.Tensor) -> str:
    """16 hex digits: the first 8 bytes (big-endian) of SHA-256 over the tensor's contiguous CPU bytes.

    Always hashes a copy: handing a tensor's memory to numpy makes its storage non-resizable for good, and the
    tensor may be a view of a live parameter, whose storage the offloader resizes to release it (offload.py)."""
    t = t.detach().to("cpu", copy=True).contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(raw)).digest()[:8].hex()


def overall_checksum(checksums: dict[str, str]) -> str:
    """One digest over every (name, checksum) pair in name order (SGLang's ``per_gpu_checksum``)."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def hf_weight_checksums(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype | None = None,
    skip_tensor_list: list[str] | None = None,
    layout: ChecksumLayout = HF_LAYOUT,
) -> dict[str, str]:
    """Checksums of (HF name, tensor) pairs in the engine's `layout`; `dtype` casts first (hash what the engine
    stores, not the sender)."""
    out: dict[str, str] = {}
    checksum = gpu_tensor_checksum if layout.gpu_hash else tensor_checksum
    for name, t in fused_hf_tensors(named_tensors) if layout.fused else named_tensors:
        if any(p in name for p in _SKIPPED) or any(p in name for p in (skip_tensor_list or ())):
            continue
        if name in out:
            raise ValueError(f"tensor {name!r} exported twice")
        out[name] = checksum(t.to(dtype) if dtype is not None else t)
    return out


def trainer_weight_checksums(
    trainer: Any, dtype: torch.dtype | None = None, layout: ChecksumLayout = HF_LAYOUT
) -> dict[str, str] | None:
    """Checksums of exactly the tensors `MegatronTrainer.export_hf` sends, in the engines' `layout`; None on ranks
    that send nothing.

    A TP collective like the export itself: every rank of the stage must call it.
    """
    named = trainer.export_hf()
    if not trainer.is_weight_sender():
        for _ in named:  # take part in the TP gathers only
            pass
        return None
    return hf_weight_checksums(named, dtype=dtype, layout=layout)


def engine_checksum_layout(url: str, names: Iterable[str] | None = None) -> ChecksumLayout:
    """How the engine at `url` names and hashes its weights: fused names if its checksums (`names`, fetched when not
    given) show any, the GPU hash if it serves on a GPU (`/server_info`'s `device`)."""
    names = list(fetch_engine_checksums(url) if names is None else names)
    with SGLangClient(url, timeout=60.0) as client:
        device = str(client.server_info().get("device") or "cuda")  # SGLang's default device
    fused = any(fused in n for n in names for fused, _, _ in _FUSED.values())
    return ChecksumLayout(fused=fused, gpu_hash=device.startswith("cuda"))


def fetch_engine_checksums(url: str, skip_tensor_list: list[str] | None = None) -> dict[str, str]:
    """The per-tensor checksums of a TP-1 engine (`/weights_checker {"action": "checksum"}`)."""
    try:
        with SGLangClient(url, timeout=120.0) as client:
            data = client.weight_checksums(skip_tensor_list)
    except SGLangError as e:
        raise WeightMismatch(str(e)) from e
    ranks = data.get("ranks") or []
    if len(ranks) != 1:
        raise WeightMismatch(f"{url}: {len(ranks)} TP ranks; per-tensor checksums compare only at engine TP 1")
    return dict(ranks[0]["checksums"])


def compare_checksums(trainer: dict[str, str], engine: dict[str, str]) -> list[str]:
    """Human-readable differences (empty list: identical): missing, unexpected and differing tensors."""
    problems = [f"{n}: not on the engine" for n in sorted(set(trainer) - set(engine))]
    problems += [f"{n}: on the engine but never sent" for n in sorted(set(engine) - set(trainer))]
    problems += [
        f"{n}: trainer {trainer[n]} != engine {engine[n]}"
        for n in sorted(set(trainer) & set(engine))
        if trainer[n] != engine[n]
    ]
    return problems


def check_engines(
    engine_urls: list[str], trainer_checksums: dict[str, str], fetched: dict[str, dict[str, str]] | None = None
) -> dict[str, float]:
    """Raise `WeightMismatch` unless every engine holds exactly the trainer's tensors; returns metrics. `fetched`:
    engines' checksums already asked for (by URL), not asked again."""
    for url in engine_urls:
        engine = (fetched or {}).get(url)
        problems = compare_checksums(trainer_checksums, fetch_engine_checksums(url) if engine is None else engine)
        if problems:
            raise WeightMismatch(f"{url}: {len(problems)} tensors differ: " + "; ".join(problems[:5]))
    logger.info(
        "weights equal on %d engines (%d tensors, %s)",
        len(engine_urls),
        len(trainer_checksums),
        overall_checksum(trainer_checksums)[:12],
    )
    return {
        "weight_sync/checked_tensors": float(len(trainer_checksums)),
        "weight_sync/checked_engines": float(len(engine_urls)),
    }


def check_trainer_on_engines(trainer: Any, engine_urls: list[str]) -> dict[str, float]:
    """`--check-weight-update-equal`: every engine's per-tensor checksums equal the trainer's (all stages); a
    collective of every train rank, which rank 0 checks."""
    import torch.distributed as dist

    fetched: dict[str, dict[str, str]] = {}
    layout: list[ChecksumLayout | None] = [None]
    if dist.get_rank() == 0:  # each engine asked once: its checksums say how it names, and are what is compared
        fetched = {url: fetch_engine_checksums(url) for url in engine_urls}
        layout[0] = engine_checksum_layout(engine_urls[0], fetched[engine_urls[0]])
    dist.broadcast_object_list(layout, src=0)  # every sender hashes as the engines do
    sums = trainer_weight_checksums(trainer, layout=layout[0])
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sums)
    if dist.get_rank() != 0:
        return {}
    merged = {k: v for part in gathered if part for k, v in part.items()}
    return check_engines(engine_urls, merged, fetched)
