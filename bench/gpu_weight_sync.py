"""Colocated weight sync on one GPU against its floor, the bare CUDA-IPC hand-off of the same bytes.

    export PYTHONPATH=$PWD/.gpu-site:$PWD; python -m bench.gpu_weight_sync --model 1.8B --out $OUT/gpu_weight_sync.json

What it runs (one GPU, megatron-core; no Ray, no router):
1. a random-init checkpoint of the shape (`bench/gpu_trainer.py`), served by the fake `hf` engine on the same GPU
   (bf16; it stands in for SGLang and copies each received bucket into its parameters before answering);
2. a colocated `MegatronTrainer` rank in this process (bf16, `--offload-train`) after one train step;
3. `--repeats` syncs each way, through the production code (`MegatronTrainer.weights_for_sync` → buckets of
   `--update-weight-buffer-size` → `TensorWeightSync` → `/update_weights_from_tensor`), the session included:
   - **live**: as `slime train` syncs after a train call — the trainer half asleep (optimizer state and grads
     released), the weights read on the GPU; then the second half of the sleep, timed apart;
   - **packed**: live, but every tensor packed into buckets (row gathers), none read in place;
   - **host**: as at start-up — the trainer asleep, the weights moved back from its pinned host copy;
   and the last live sync event by event, both sides (`timeline`: where its milliseconds go);
4. the floor: one flat bf16 tensor of the same bytes handed to a second process (pickled as CUDA IPC handles,
   opened there, copied into a buffer of its own, synchronized, acknowledged).
5. `--parts`: each part of a live sync alone, synchronized, medians (`sync_parts` names them): the tensors read
   in place (serialized as IPC handles of the trainer's own buffer, posted), the strided rest (allocated, packed,
   serialized, posted), the engine's own account of each post, one control call's round trip, and for
   comparison the copy of every tensor into one flat buffer.
After the syncs it checks every tensor's checksum on the engine against the trainer's. Prints a table with each
way's median and its ratio to the floor, and writes JSON. A bench, not a test: it never asserts.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing.connection
import os
import pickle
import tempfile
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

from bench.gpu_trainer import SHAPES, bench_setup, log, median, write_json


def _receiver(conn: multiprocessing.connection.Connection, numel: int) -> None:
    """The floor's other side: open each handle, copy into our own buffer, synchronize, answer."""
    import torch

    dst = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    conn.send("ready")
    while True:
        msg = conn.recv_bytes()
        if msg == b"stop":
            return
        src = pickle.loads(msg)
        dst.copy_(src)
        torch.cuda.synchronize()
        del src
        conn.send("done")


def bare_handoff(numel: int, repeats: int) -> list[float]:
    """Seconds per hand-off of `numel` bf16 values to a second process (pickle, open, copy, acknowledge)."""
    import torch
    import torch.multiprocessing as mp
    import torch.multiprocessing.reductions  # noqa: F401 - CUDA tensors pickle as IPC handles

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, numel), daemon=True)
    proc.start()
    parent.recv()
    src = torch.randn(numel, device="cuda").to(torch.bfloat16)
    torch.cuda.synchronize()
    times = []
    try:
        for _ in range(repeats + 2):  # the first two open the process's CUDA IPC machinery
            t0 = time.perf_counter()
            parent.send_bytes(bytes(ForkingPickler.dumps(src)))
            parent.recv()
            times.append(time.perf_counter() - t0)
    finally:
        parent.send_bytes(b"stop")
        proc.join(30)
    return times[2:]


def timeline(trace: list[tuple[str, float]], request_log: Path) -> list[str]:
    """One sync's events, both sides, in ms from its start: the trainer's (`TensorWeightSync.trace`: session
    opened/closed, payloads ready, posts' start and end) and each engine request it made (the server's own span,
    and for a post the engine's unpickle / views / copy)."""
    t0, t1 = trace[0][1], trace[-1][1]
    rows = [(t - t0, f"trainer  {event}") for event, t in trace]
    for line in request_log.read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        if not t0 <= r.get("ts_start", 0.0) <= t1:
            continue
        parts = [f"read {(r['parsed_at'] - r['ts_start']) * 1e3:.2f}"] if "parsed_at" in r else []
        parts += [f"{k[:-2]} {r[k] * 1e3:.2f}" for k in ("unpickle_s", "views_s", "load_s") if k in r]
        span = (r["ts_end"] - r["ts_start"]) * 1e3
        rows.append((r["ts_start"] - t0, f"engine   {r['endpoint']} for {span:.2f} ms {' '.join(parts)}".rstrip()))
    return [f"{at * 1e3:7.2f} ms  {what}" for at, what in sorted(rows)]


def sync_parts(trainer: Any, off: Any, url: str, version: int, repeats: int, request_log: Path) -> dict[str, float]:
    """Seconds of each part of a live sync on its own (see the module docstring, item 5), medians:
    `split`: finding the tensors read in place (`in_place_buckets`); `serialize_in_place` / `post_in_place`: their
    payload (IPC handles of the trainer's own buffers) and its post; `alloc` / `copy` / `serialize` / `post`: the
    packed rest (the strided q/k/v views) by a copy per tensor, and `gather`: the same by row gathers (allocation
    included), as syncs pack it; `copy_all` / `copy_all_plain`: for comparison, every tensor packed into
    one flat buffer (as syncs did before reading in place), from the trainer's views and from plain CUDA twins of
    them; `engine_*`: the engine's own account of the posts (`unpickle` opens the IPC handle; `views` cuts the
    tensors out; `decode` is both; `load` is the copy into its parameters,
    synchronized)."""
    import torch

    from slime.backends.megatron.weight_buckets import GatherPlan, flatten, in_place_buckets, new_buffer
    from slime.backends.megatron.weight_sync import serialize
    from slime.backends.sglang.client import SGLangClient, begin_weight_sync, end_weight_sync

    off.wake_up()
    off.sleep(keep_weights=True)
    items = trainer.weights_for_sync()
    plain = []
    for name, src, shape, dtype in items:
        twin = torch.empty_strided(src.size(), src.stride(), dtype=src.dtype, device=src.device)
        plain.append((name, twin.copy_(src), shape, dtype))
    client = SGLangClient(url)
    runs: dict[str, list[float]] = {}

    def timed(key: str, fn: Any) -> Any:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        runs.setdefault(key, []).append(time.perf_counter() - t0)
        return out

    def post(key: str, payload: str) -> None:
        nonlocal version
        begin_weight_sync([client])
        version += 1
        timed(key, lambda: client.update_weights_from_tensor([payload], str(version)))
        end_weight_sync([client])

    for _ in range(repeats + 1):
        torch.cuda.empty_cache()
        everything = new_buffer(list(items))
        timed("copy_all_plain", lambda b=everything, twins=plain: flatten(twins, b))
        timed("copy_all", lambda b=everything: flatten(list(items), b))
        del everything
        in_place, rest = timed("split", lambda: in_place_buckets(items))
        (flat, meta, _), *more = in_place
        assert not more, "one DDP buffer expected"
        payload = timed("serialize_in_place", lambda f=flat, m=meta: serialize({"flattened_tensor": f, "metadata": m}))
        post("post_in_place", payload)
        buffer = timed("alloc", lambda r=rest: new_buffer(r))
        flat, meta = timed("copy", lambda b=buffer, r=rest: flatten(r, b))
        plan = GatherPlan.of(rest)
        timed("gather", plan.pack)  # what a sync packs with (`LiveWeights.plan`): allocation and row gathers
        payload = timed("serialize", lambda f=flat, m=meta: serialize({"flattened_tensor": f, "metadata": m}))
        post("post", payload)
        for _ in range(10):
            timed("round_trip", lambda: client.request("GET", "/get_server_info"))
        del buffer, flat, payload, in_place, rest, plan
    client.close()
    del plain
    off.sleep()
    out = {k: median(v[1:] if len(v) > repeats else v) for k, v in runs.items()}
    records = [json.loads(x) for x in request_log.read_text().splitlines() if x.strip()]
    posts = [r for r in records if r.get("endpoint") == "/update_weights_from_tensor" and "load_s" in r]
    for i, way in enumerate(("in_place", "packed")):  # the posts alternate: in place, then the packed rest
        mine = posts[-2 * repeats :][i::2]
        for key in ("unpickle_s", "views_s", "decode_s", "load_s"):
            out[f"engine_{way}_{key[:-2]}"] = median([r.get(key, 0.0) for r in mine])
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from bench.requires import require, require_cuda

    require(["megatron.core", "aiohttp"], "bash scripts/install.sh (megatron-core is a main dependency)")
    require_cuda()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="1.8B")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, nargs="+", default=None, help="--update-weight-buffer-size values in MiB")
    p.add_argument("--parts", action="store_true", help="also time each part of a live sync alone")
    p.add_argument("--work", default=None, help="where the checkpoint is built (reused when present)")
    p.add_argument("--out", default="bench/results/gpu_weight_sync.json")
    a = p.parse_args(argv)

    from sim.fake_sglang.testing import launch_fake_sglang
    from slime.backends.megatron.weight_buckets import LiveWeights
    from slime.backends.megatron.weight_hash import (
        WeightMismatch,
        check_engines,
        engine_checksum_layout,
        trainer_weight_checksums,
    )
    from slime.backends.megatron.weight_sync import TensorWeightSync

    res, ckpt, (args, trainer, off) = bench_setup(a.model, a.work)
    sizes = [mb * 2**20 for mb in a.bucket_mb] if a.bucket_mb else [args.update_weight_buffer_size]
    request_log = Path(tempfile.mkdtemp()) / "requests.jsonl"
    engine_args = ["--engine", "hf", "--model-path", str(ckpt), "--device", "cuda", "--dtype", "bfloat16",
                   "--request-log", str(request_log)]  # fmt: skip
    res["by_bucket"] = {}
    version = 0
    with launch_fake_sglang(engine_args, timeout=600) as eng:
        # both processes take turns on a CPU they share: the sync's CPU work on each side is then serial
        res["cpus"] = {
            "trainer": sorted(os.sched_getaffinity(0)),
            "engine": sorted(os.sched_getaffinity(eng.proc.pid)),
        }
        log(f"CPUs the trainer may run on: {res['cpus']['trainer']}, the engine: {res['cpus']['engine']}")
        for bucket in sizes:
            sync = TensorWeightSync([eng.url], bucket)

            def on_gc(phase: str, info: dict[str, Any], sync: TensorWeightSync = sync) -> None:
                if sync.trace is not None:  # this process's garbage collections, in the timeline of the traced sync
                    sync.trace.append((f"gc of generation {info['generation']}: {phase}", time.time()))

            gc.callbacks.append(on_gc)
            runs: dict[str, list[dict[str, float]]] = {"live": [], "host": [], "packed": []}
            packed_views = None
            release: list[float] = []
            for i in range(a.repeats + 1):  # the first of each way opens connections and warms the allocator
                off.wake_up()
                off.sleep(keep_weights=True)  # what the train call leaves behind when a sync follows
                sync.trace = [] if i == a.repeats else None  # the last live sync's timeline
                t0 = time.perf_counter()
                m = sync.sync(trainer.weights_for_sync(), version := version + 1)
                m["total_s"] = time.perf_counter() - t0
                if sync.trace:
                    trace = timeline(sync.trace, request_log)
                    sync.trace = None
                t0 = time.perf_counter()
                off.sleep()  # the sleep's second half: params to the pinned copy, released
                if i:
                    runs["live"].append(m)
                    release.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                h = sync.sync(trainer.weights_for_sync(), version := version + 1)  # asleep: from the pinned host copy
                h["total_s"] = time.perf_counter() - t0
                if i:
                    runs["host"].append(h)
                off.wake_up()
                off.sleep(keep_weights=True)
                if packed_views is None:  # the same kept views, not handed over: every tensor packed (row gathers)
                    packed_views = LiveWeights(trainer.weights_for_sync(), hand_over=False)
                t0 = time.perf_counter()
                p = sync.sync(packed_views, version := version + 1)
                p["total_s"] = time.perf_counter() - t0
                off.sleep()
                if i:
                    runs["packed"].append(p)
                log(
                    f"buckets of {bucket / 2**20:.0f} MiB, sync {i}: live {m['total_s']:.4f}s host {h['total_s']:.4f}s"
                )
            sync.close()
            gc.callbacks.remove(on_gc)
            entry: dict[str, Any] = {"release_weights_s": median(release), "live_timeline": trace}
            log(f"the last live sync with {bucket / 2**20:.0f} MiB buckets, event by event:\n" + "\n".join(trace))
            for way, ms in runs.items():
                entry[way] = {k: median([m[k] for m in ms]) for k in ms[0]}
                entry[way]["all_total_s"] = [m["total_s"] for m in ms]
            res["by_bucket"][str(bucket)] = entry
            res["bytes"] = int(runs["live"][0]["weight_sync/bytes"])
            write_json(a.out, res)
        if a.parts:
            res["parts_s"] = sync_parts(trainer, off, eng.url, version + 100, a.repeats, request_log)
            version += 100 + a.repeats + 1
            log(
                "parts of a live sync, each alone: "
                + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in res["parts_s"].items())
            )
        try:
            check_engines([eng.url], trainer_weight_checksums(trainer, layout=engine_checksum_layout(eng.url)))
            res["engine_weights_equal"] = True
        except WeightMismatch as e:
            res["engine_weights_equal"], res["mismatch"] = False, str(e)
    log(f"bare IPC hand-off of {res['bytes'] / 1e9:.2f} GB")
    bare = bare_handoff(res["bytes"] // 2, a.repeats)
    res["bare_s"] = {"median": median(bare), "all": bare}
    write_json(a.out, res)
    print(report(res))
    return res


def report(res: dict[str, Any]) -> str:
    floor = res["bare_s"]["median"]
    gb = res["bytes"] / 1e9
    lines = [
        f"weight sync, {res['model']} ({gb:.2f} GB bf16), {res['gpu']}, medians (export and pack run in a thread, "
        "overlapping the posts and the session; `waited`: what of them the posts waited for):",
        "| way | bucket MiB | total s | GB/s | × bare IPC | export s | pack s | post s | waited s | session s | buckets |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| bare IPC hand-off (floor) | {gb * 1e9 / 2**20:.0f} | {floor:.4f} | {gb / floor:.0f} | 1.00 | | | | | | 1 |",
    ]
    for bucket, entry in res["by_bucket"].items():
        for way, label in (
            ("live", "live GPU weights (after a train call)"),
            ("packed", "the same, every tensor packed (no hand-over)"),
            ("host", "pinned host copy (asleep)"),
        ):
            r = entry[way]
            lines.append(
                f"| {label} | {int(bucket) / 2**20:.0f} | {r['total_s']:.4f} | {gb / r['total_s']:.0f} | "
                f"{r['total_s'] / floor:.2f} | {r['weight_sync/export_s']:.4f} | {r['weight_sync/pack_s']:.4f} | "
                f"{r['weight_sync/post_s']:.4f} | {r.get('weight_sync/wait_s', 0.0):.4f} | "
                f"{r['weight_sync/session_s']:.4f} | {r['weight_sync/buckets']:.0f} |"
            )
    release = ", ".join(f"{e['release_weights_s']:.4f}" for e in res["by_bucket"].values())
    lines.append(f"the sleep's second half after a live sync (params to pinned memory, released): {release} s")
    lines.append(f"engine weights equal the trainer's after the syncs: {res['engine_weights_equal']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
