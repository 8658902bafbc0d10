"""Weight-sync cost on CPU: colocated tensor path vs the disaggregated broadcast (gloo), to fake `hf` engines.

    python bench/weight_sync_cpu.py [--hidden-size 512 --layers 8 --repeats 3 --out bench/results/weight_sync_cpu.json]

Builds a random Qwen2-shaped checkpoint, starts two fake engines (1 and 2 "GPUs"), and times one full sync of
every parameter (fp32) after a warm-up sync: `TensorWeightSync` (shared-memory handles over HTTP, one engine)
and `DistributedWeightSync` (one broadcast per bucket over a gloo group, to one engine and to both), per
bucket size. The group set-up (rendezvous of 1 + Σ ranks) is timed separately. Prints a table, writes JSON.
Never asserts on time: on 2 shared cores the numbers are indicative only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--buckets-mib", type=int, nargs="+", default=[64, 512])
    p.add_argument("--out", default="bench/results/weight_sync_cpu.json")
    p.add_argument("--workdir", default="/tmp/slime_bench_weight_sync")
    a = p.parse_args()

    from transformers import AutoModelForCausalLM

    from sim.fake_sglang.testing import launch_fake_sglang
    from sim.tiny_checkpoint import build_tiny_checkpoint
    from slime.backends.megatron.weight_sync import TensorWeightSync
    from slime.backends.megatron.weight_sync_distributed import DistributedWeightSync, EngineTarget
    from slime.backends.sglang.client import SGLangClient, begin_weight_sync, end_weight_sync

    ckpt = build_tiny_checkpoint(
        Path(a.workdir) / f"model_h{a.hidden_size}_l{a.layers}", hidden_size=a.hidden_size, num_layers=a.layers,
        num_heads=8, num_kv_heads=4, intermediate_size=3 * a.hidden_size,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    mib = sum(t.numel() * t.element_size() for _, t in named) / 2**20
    rows = []
    common = ["--engine", "hf", "--model-path", str(ckpt)]
    with launch_fake_sglang(common) as e1, launch_fake_sglang([*common, "--tp-size", "2"]) as e2:
        for bucket_mib in a.buckets_mib:
            bucket = bucket_mib << 20
            tensor = TensorWeightSync([e1.url], bucket_bytes=bucket)
            tensor.sync(named, 0)
            times = []
            for v in range(a.repeats):
                t0 = time.perf_counter()
                tensor.sync(named, v + 1)
                times.append(time.perf_counter() - t0)
            tensor.close()
            rows.append({"path": "tensor", "bucket_mib": bucket_mib, "engines": 1, "ranks": 1,
                         "sync_s": statistics.median(times), "setup_s": 0.0})  # fmt: skip
            for targets in ([EngineTarget(e1.url, 1)], [EngineTarget(e1.url, 1), EngineTarget(e2.url, 2)]):
                sync = DistributedWeightSync(bucket_bytes=bucket)
                t0 = time.perf_counter()
                sync.connect(targets)
                setup = time.perf_counter() - t0
                clients = [SGLangClient(t.url) for t in targets]
                times = []
                for v in range(a.repeats + 1):
                    t0 = time.perf_counter()
                    begin_weight_sync(clients)
                    sync.send(named, v)
                    end_weight_sync(clients)
                    times.append(time.perf_counter() - t0)
                sync.close()
                for c in clients:
                    c.close()
                rows.append({"path": "distributed", "bucket_mib": bucket_mib, "engines": len(targets),
                             "ranks": 1 + sum(t.num_gpus for t in targets), "sync_s": statistics.median(times[1:]),
                             "setup_s": setup})  # fmt: skip
    print(f"{sum(t.numel() for _, t in named) / 1e6:.1f}M fp32 parameters, {mib:.0f} MiB per sync")
    print(f"{'path':<12} {'bucket MiB':>10} {'engines':>7} {'ranks':>5} {'sync s':>8} {'MiB/s':>7} {'setup s':>8}")
    for r in rows:
        r["mib_per_s"] = mib / r["sync_s"]
        print(f"{r['path']:<12} {r['bucket_mib']:>10} {r['engines']:>7} {r['ranks']:>5} {r['sync_s']:>8.3f} "
              f"{r['mib_per_s']:>7.0f} {r['setup_s']:>8.3f}")  # fmt: skip
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"mib": mib, "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
