"""Where a CUDA-IPC bucket hand-off's fixed costs go, piece by piece, on one GPU and two processes (torch only).

    python -m bench.gpu_ipc_parts --out $OUT/gpu_ipc_parts.json

`bench/gpu_weight_sync.py` times whole syncs of a ~2B model and the engine's own account of each post; this one
takes a post apart with the shapes of that model's buckets (the trainer's buffer read in place: 218 tensors,
3.07 GB; the q/k/v packed by gathers: 144 tensors, 604 MB) and the production code on both sides
(`weight_sync.serialize`, `sim.fake_sglang.weights.decode_payload`):
- sender: serializing a bucket whose storage was shared before / is new (allocated each time) / has a kernel still
  writing it (does sharing wait for the GPU?), and the metadata alone;
- receiver: unpickling (the IPC handle opened), the metadata alone, the views, and copying the views into
  separate parameters three ways (one grouped `_foreach_copy_`, a `copy_` per tensor, one flat copy);
- a pipe round trip, for scale.
Medians of `--repeats`. A bench, not a test: it prints a table and writes JSON, and never asserts.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing.connection
import statistics
import time
from pathlib import Path
from typing import Any

LAYERS = 24


def _shapes(shrink: int = 1) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(in-place tensors, q/k/v tensors) of the 1.8B Qwen2 shape (hidden 2048, 16 heads, ffn 5504, vocab 151936),
    every size divided by `shrink` (a dry run on CPU)."""
    h, ffn, vocab = 2048 // shrink, 5504 // shrink, 151936 // shrink
    layer = [(h, h), (ffn, h), (ffn, h), (h, ffn), (h,), (h,), (h,), (h,), (h,)]
    in_place = [(vocab, h)] + layer * LAYERS + [(vocab, h)]
    qkv = [(h, h), (h, h), (h, h), (h,), (h,), (h,)] * LAYERS
    return in_place, qkv


def _meta(shapes: list[tuple[int, ...]], prefix: str) -> list[Any]:
    import torch

    from slime.backends.megatron.weight_buckets import tensor_metadata

    out, start = [], 0
    for i, s in enumerate(shapes):
        size = torch.Size(s)
        out.append(tensor_metadata(f"{prefix}.{i}.weight", size, torch.bfloat16, start, start + size.numel(),
                                           size.numel()))  # fmt: skip
        start += size.numel()
    return out


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def _receiver(conn: multiprocessing.connection.Connection) -> None:
    """Decode each payload as the fake engine does, time its parts, copy into parameters of our own."""
    import torch

    from sim.fake_sglang.weights import FLATTENED_BUCKET, _bucket_slices, decode_payload, deserialize

    params: dict[str, torch.Tensor] = {}
    flat_dst: dict[int, torch.Tensor] = {}
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg == "stop":
            return
        if msg == "ping":
            conn.send("pong")
            continue
        kind, payload, meta_only = msg
        t: dict[str, float] = {}
        t0 = time.perf_counter()
        deserialize(meta_only)
        t["meta_unpickle"] = time.perf_counter() - t0
        parts: dict[str, float] = {}
        t0 = time.perf_counter()
        named = decode_payload([payload], FLATTENED_BUCKET, parts)
        t["decode"] = time.perf_counter() - t0
        t.update(parts)
        sync = torch.cuda.synchronize if named[0][1].is_cuda else (lambda: None)
        for n, v in named:
            if n not in params:
                params[n] = torch.empty_like(v)
        dst = [params[n] for n, _ in named]
        src = [v for _, v in named]
        sync()
        t0 = time.perf_counter()
        torch._foreach_copy_(dst, src)
        sync()
        t["copy_foreach"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
        sync()
        t["copy_each"] = time.perf_counter() - t0
        for alone in (1 << 20, 1 << 24, 1 << 26):  # the fake engine's way (hf_engine.load_received), by threshold
            big = [(d, s) for d, s in zip(dst, src, strict=True) if s.numel() >= alone]
            small = [(d, s) for d, s in zip(dst, src, strict=True) if s.numel() < alone]
            t0 = time.perf_counter()
            for d, s in big:
                d.copy_(s)
            if small:
                torch._foreach_copy_([d for d, _ in small], [s for _, s in small])
            sync()
            t[f"copy_alone_from_2^{alone.bit_length() - 1}"] = time.perf_counter() - t0
        storage = named[0][1].untyped_storage()  # the bucket's (opening the payload again would reopen the handle)
        flat = torch.empty(0, dtype=named[0][1].dtype, device=named[0][1].device).set_(
            storage, 0, (storage.nbytes() // named[0][1].element_size(),)
        )
        key = flat.numel()
        if key not in flat_dst:
            flat_dst[key] = torch.empty_like(flat)
        t0 = time.perf_counter()
        flat_dst[key].copy_(flat)
        sync()
        t["copy_flat"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        _bucket_slices(flat, deserialize(meta_only))
        t["views_alone"] = time.perf_counter() - t0
        del named, src, flat
        conn.send((kind, t))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the bench itself (shared memory, no IPC)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import torch
    import torch.multiprocessing as mp

    from slime.backends.megatron.weight_sync import serialize

    dev = args.device
    sync = torch.cuda.synchronize if dev == "cuda" else lambda: None
    in_place_shapes, qkv_shapes = _shapes(1 if dev == "cuda" else 16)
    meta_in_place, meta_qkv = _meta(in_place_shapes, "in_place"), _meta(qkv_shapes, "qkv")
    n_in_place, n_qkv = meta_in_place[-1].end_idx, meta_qkv[-1].end_idx
    kept = torch.randn(n_in_place, device=dev, dtype=torch.bfloat16)
    source = torch.randn(n_qkv, device=dev, dtype=torch.bfloat16)
    busy = torch.randn(8192 if dev == "cuda" else 64, 8192 if dev == "cuda" else 64, device=dev)
    sync()

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child,), daemon=True)
    proc.start()
    parent.recv()
    sender: dict[str, list[float]] = {}
    receiver: dict[str, dict[str, list[float]]] = {}

    def timed(key: str, fn: Any, *fn_args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*fn_args, **kwargs)
        sender.setdefault(key, []).append(time.perf_counter() - t0)
        return out

    try:
        for i in range(args.repeats + 2):
            keep = i >= 2  # the first two open each side's CUDA IPC machinery
            payload = timed("serialize_same_storage", serialize, {"flattened_tensor": kept, "metadata": meta_in_place})
            meta_only = timed("serialize_meta_alone", serialize, meta_in_place)
            parent.send(("in_place", payload, meta_only))
            kind, t = parent.recv()
            fresh = timed("alloc_in_place", torch.empty, n_in_place, device=dev, dtype=torch.bfloat16)
            timed("serialize_new_in_place", serialize, {"flattened_tensor": fresh, "metadata": meta_in_place})
            del fresh
            flat = timed("alloc", torch.empty, n_qkv, device=dev, dtype=torch.bfloat16)
            flat.copy_(source)
            sync()
            payload = timed("serialize_new_storage", serialize, {"flattened_tensor": flat, "metadata": meta_qkv})
            flat2 = torch.empty(n_qkv, device=dev, dtype=torch.bfloat16)
            for _ in range(4):
                busy @ busy  # ~1 ms of work queued ahead of the copy into flat2
            flat2.copy_(source)
            timed("serialize_while_gpu_busy", serialize, {"flattened_tensor": flat2, "metadata": meta_qkv})
            sync()
            parent.send(("qkv", payload, serialize(meta_qkv)))
            kind2, t2 = parent.recv()
            t0 = time.perf_counter()
            parent.send("ping")
            parent.recv()
            sender.setdefault("pipe_round_trip", []).append(time.perf_counter() - t0)
            del flat, flat2, payload
            if not keep:
                for k in sender:
                    sender[k].clear()
                continue
            for k, v in t.items():
                receiver.setdefault(kind, {}).setdefault(k, []).append(v)
            for k, v in t2.items():
                receiver.setdefault(kind2, {}).setdefault(k, []).append(v)
    finally:
        parent.send("stop")
        proc.join(30)
    res = {
        "gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "tensors": {"in_place": len(meta_in_place), "qkv": len(meta_qkv)},
        "bytes": {"in_place": 2 * n_in_place, "qkv": 2 * n_qkv},
        "sender_ms": {k: _median_ms(v) for k, v in sender.items() if v},
        "receiver_ms": {kind: {k: _median_ms(v) for k, v in d.items()} for kind, d in receiver.items()},
    }
    print(report(res))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
    return res


def report(res: dict[str, Any]) -> str:
    lines = [f"{res['gpu']}, torch {res['torch']}, {res['date']}", "", "| sender | ms |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in res["sender_ms"].items()]
    for kind, d in res["receiver_ms"].items():
        lines += ["", f"| receiver, {kind} ({res['tensors'][kind]} tensors, {res['bytes'][kind] / 1e9:.2f} GB) | ms |",
                  "|---|---|"]  # fmt: skip
        lines += [f"| {k} | {v:.3f} |" for k, v in d.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
