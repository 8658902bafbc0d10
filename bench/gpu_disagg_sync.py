"""Disaggregated weight sync on two GPUs: trainer on GPU 0, engine on GPU 1, weights broadcast over NCCL.

    export PYTHONPATH=$PWD/.gpu-site:$PWD; python -m bench.gpu_disagg_sync --out $OUT/gpu_disagg_sync.json

What it measures, in one run on the same host:
1. the floor: an NCCL broadcast of the same byte count from GPU 0 to GPU 1 between two plain processes (GB/s);
2. `slime train` with a ~2B Qwen2-shaped bf16 checkpoint (random init, the tiny tokenizer), `--actor-num-gpus-per-node
   1 --rollout-num-gpus 1` (update-weight-mode distributed), the fake `hf` engine on GPU 1 (SGLang is not installed on
   the lent host): per sync, the sender's time (HF conversion + bucketing + broadcast, `weight_sync/send_s`) and the
   whole sync as the driver sees it (`time/weight_sync`: pause, session, barriers, engine load).

Prints a table with GB/s and the ratio to the floor, writes JSON. A bench: it never asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.offload_memory_gpu import build_checkpoint, log, run_job, write_prompts
from bench.requires import require, require_cuda

ROOT = Path(__file__).resolve().parents[1]


def _bcast_worker(rank: int, port: int, nbytes: int, reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for _ in range(2):  # warm-up: communicator set-up and the first transfer's lazy init
        dist.broadcast(buf, src=0)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.broadcast(buf, src=0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({"bytes": nbytes, "times_s": times}))
    dist.destroy_process_group()


def nccl_floor(nbytes: int, reps: int, work: Path) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from slime.utils.http_utils import find_free_port

    out = work / "bcast.json"
    mp.spawn(_bcast_worker, args=(find_free_port(), nbytes, reps, str(out)), nprocs=2)
    r = json.loads(out.read_text())
    best = min(r["times_s"])
    return {**r, "best_s": best, "GBps": nbytes / best / 1e9}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results/gpu_disagg_sync.json")
    p.add_argument("--workdir", default="/tmp/slime_gpu_disagg_sync")
    p.add_argument("--rollouts", type=int, default=3)
    p.add_argument("--hidden-size", type=int, default=2560)
    p.add_argument("--ffn-hidden-size", type=int, default=6912)
    p.add_argument("--num-layers", type=int, default=30)
    p.add_argument("--num-heads", type=int, default=20)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--bucket-mb", type=int, default=512, help="--update-weight-buffer-size in MiB")
    p.add_argument("--timeout-s", type=float, default=420.0)
    a = p.parse_args(argv)
    require_cuda()
    require(["megatron.core", "ray", "sglang_router"], "the GPU packs (README: 'One GPU host')")
    import torch

    if torch.cuda.device_count() < 2:
        sys.exit(f"this bench needs two GPUs; torch sees {torch.cuda.device_count()}")

    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    out_path = Path(a.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv[1:]}
    res["device"] = {
        "name": torch.cuda.get_device_name(0),
        "count": torch.cuda.device_count(),
        "torch": torch.__version__,
    }

    def save() -> None:
        out_path.write_text(json.dumps(res, indent=1, default=str))

    t0 = time.perf_counter()
    model = build_checkpoint(work, a)
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(
            p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).parameters()
        )
    res["checkpoint"] = {"path": str(model), "build_s": round(time.perf_counter() - t0, 1), "params": params}
    log(f"checkpoint {model} in {res['checkpoint']['build_s']} s")
    save()
    flags = [
        "--bf16", "--hf-checkpoint", str(model), "--prompt-data", str(write_prompts(work / "prompts.jsonl")),
        "--input-key", "input", "--rm-type", "random", "--rollout-engine", "sim", "--sim-engine", "hf",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
        "--num-rollout", str(a.rollouts), "--rollout-max-response-len", "8", "--lr", "1e-6", "--seed", "1234",
        "--update-weight-buffer-size", str(a.bucket_mb * 2**20), "--no-use-tensorboard",
        "--metrics-dir", str(work / "metrics"),
    ]  # fmt: skip
    log("slime train (disaggregated, NCCL weight sync)")
    run = run_job(flags, work / "train.log", a.timeout_s)
    records = []
    mpath = work / "metrics" / "metrics.jsonl"
    for line in mpath.read_text().splitlines() if mpath.is_file() else []:
        rec = json.loads(line)
        if rec.get("kind") == "train" and "weight_sync/send_s" in rec.get("metrics", {}):
            records.append(rec["metrics"])
    run["syncs"] = [
        {k: m[k] for k in ("weight_sync/bytes", "weight_sync/buckets", "weight_sync/send_s", "time/weight_sync")}
        for m in records
    ]
    if run["returncode"] != 0 or not records:
        run["log_tail"] = (work / "train.log").read_text()[-4000:]
    res["train"] = run
    save()
    nbytes = int(records[-1]["weight_sync/bytes"]) if records else 4 * 2**30
    log(f"NCCL broadcast floor for {nbytes / 1e9:.2f} GB")
    res["floor"] = nccl_floor(nbytes, 5, work)
    save()

    floor = res["floor"]["GBps"]
    lines = [f"NCCL broadcast GPU0 -> GPU1, {nbytes / 1e9:.2f} GB: {res['floor']['best_s'] * 1e3:.0f} ms = {floor:.0f} GB/s",
             "", f"{'sync':>5}{'bytes (GB)':>12}{'buckets':>9}{'send (ms)':>11}{'GB/s':>8}{'x floor':>9}{'whole sync (ms)':>17}"]  # fmt: skip
    for i, s in enumerate(run["syncs"]):
        gbps = s["weight_sync/bytes"] / s["weight_sync/send_s"] / 1e9
        lines.append(f"{i:>5}{s['weight_sync/bytes'] / 1e9:>12.2f}{int(s['weight_sync/buckets']):>9}"
                     f"{s['weight_sync/send_s'] * 1e3:>11.0f}{gbps:>8.1f}{floor / gbps:>9.2f}"
                     f"{s['time/weight_sync'] * 1e3:>17.0f}")  # fmt: skip
    res["table"] = "\n".join(lines)
    save()
    print(res["table"])
    if "log_tail" in run:
        print(run["log_tail"][-2000:])
    print(f"JSON: {out_path}")
    return res


if __name__ == "__main__":
    main()
