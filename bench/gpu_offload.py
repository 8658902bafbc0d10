"""Offload and onload of a colocated trainer on one GPU against pinned PCIe, and what a sleeping trainer still holds.

    export PYTHONPATH=$PWD/.gpu-site:$PWD; python -m bench.gpu_offload --model 1.8B --out $OUT/gpu_offload.json

What it runs (one GPU, megatron-core, torch_memory_saver; no Ray, no engine): a colocated `MegatronTrainer` rank
(bf16, `--offload-train`, the default offload policy of `slime/backends/megatron/offload.py`) after one train
step, then `--repeats` times: `sleep` (optimizer state and params to pinned host memory, grads and params
released, the optimizer's region paused), the GPU memory while asleep, `wake_up`. And the floor: host↔device
copies of a pinned buffer (`--probe-gib`), whose GB/s give the time pinned PCIe needs for the bytes one sleep
and one wake-up move. Prints a table with the ratio to that floor and writes JSON. A bench: it never asserts.

GPU memory while asleep is read three ways: `total − free` of the device (this process alone is on it: the CUDA
context, cuBLAS and NCCL workspaces, the caching allocator's segments), the allocator's reserved bytes and the
bytes still allocated (tensors that stay: rotary tables, the optimizer's step counters).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.gpu_trainer import SHAPES, bench_setup, log, median, write_json

GIB = 2**30


def pinned_bandwidth(nbytes: int, repeats: int = 3) -> dict[str, float]:
    """Host→device and device→host GB/s of one pinned buffer of `nbytes`."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out: dict[str, list[float]] = {"h2d": [], "d2h": []}
    for _ in range(repeats + 1):
        for way, (dst, src) in (("h2d", (dev, host)), ("d2h", (host, dev))):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            out[way].append(nbytes / (time.perf_counter() - t0) / 1e9)
    del host, dev
    torch.cuda.empty_cache()
    return {k: median(v[1:]) for k, v in out.items()}


def device_state() -> dict[str, float]:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "device_used_gib": (total - free) / GIB,
        "reserved_gib": torch.cuda.memory_reserved() / GIB,
        "allocated_gib": torch.cuda.memory_allocated() / GIB,
    }


def bare_process_gib() -> float:
    """GPU memory of a process that only made a CUDA context and ran one bf16 matmul (cuBLAS workspace)."""
    import subprocess
    import sys

    code = ("import torch; a = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16); (a @ a).sum().item(); "
            "torch.cuda.synchronize(); f, t = torch.cuda.mem_get_info(); print((t - f) / 2**30)")  # fmt: skip
    ours = device_state()["device_used_gib"]  # the device is shared with this process: count the difference
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return float(out.stdout.strip().splitlines()[-1]) - ours if out.returncode == 0 else float("nan")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from bench.requires import require, require_cuda

    require(["megatron.core", "torch_memory_saver"], "the GPU packs (ci/gpu-nightly.sh's header says how)")
    require_cuda()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="1.8B")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--probe-gib", type=float, default=4.0, help="size of the pinned buffer that measures PCIe")
    p.add_argument("--work", default=None, help="where the checkpoint is built (reused when present)")
    p.add_argument("--out", default="bench/results/gpu_offload.json")
    a = p.parse_args(argv)

    res, _, (_, trainer, off) = bench_setup(a.model, a.work)
    res["policy"], res["backend"] = off.policy, off.backend
    res["bytes"] = {"params": off.param_bytes, "grads": off.grad_bytes, "optimizer": off.optimizer_bytes}
    res["awake"] = device_state()
    sleeps, wakes, asleep = [], [], []
    for i in range(a.repeats + 1):  # the first sleep allocates and page-locks the host buffers
        t0 = time.perf_counter()
        off.sleep()
        t_sleep = time.perf_counter() - t0
        state = device_state()
        t0 = time.perf_counter()
        off.wake_up()
        t_wake = time.perf_counter() - t0
        log(f"round {i}: sleep {t_sleep:.3f}s wake {t_wake:.3f}s asleep {state['device_used_gib']:.2f} GiB on the GPU")
        if i:
            sleeps.append(t_sleep)
            wakes.append(t_wake)
            asleep.append(state)
    halves = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        off.sleep(keep_weights=True)
        t1 = time.perf_counter()
        off.sleep()
        halves.append((t1 - t0, time.perf_counter() - t1))
        off.wake_up()
    res["host_asleep_bytes"] = sum(off.ledger.host.values())
    # what the sleeping process's fixed part is made of: without its NCCL communicators, and a bare process
    off.sleep()
    import torch.distributed as dist

    dist.destroy_process_group()
    res["asleep_without_process_groups"] = device_state()
    off.wake_up()
    del trainer
    res["bare_process"] = bare_process_gib()
    log(f"pinned PCIe probe, {a.probe_gib:.0f} GiB")
    bw = pinned_bandwidth(int(a.probe_gib * GIB))
    moved = off.optimizer_bytes + off.param_bytes  # each way: what leaves at sleep and comes back at wake-up
    res["pcie_gbps"] = bw
    res["moved_bytes_each_way"] = moved
    res["floor_s"] = {"sleep": moved / bw["d2h"] / 1e9, "wake_up": moved / bw["h2d"] / 1e9}
    res["sleep_s"], res["wake_up_s"] = median(sleeps), median(wakes)
    res["first_half_s"] = median([h[0] for h in halves])
    res["second_half_s"] = median([h[1] for h in halves])
    res["asleep"] = {k: median([s[k] for s in asleep]) for k in asleep[0]}
    write_json(a.out, res)
    print(report(res))
    return res


def report(res: dict[str, Any]) -> str:
    f = res["floor_s"]
    moved = res["moved_bytes_each_way"] / GIB
    both, floor = res["sleep_s"] + res["wake_up_s"], f["sleep"] + f["wake_up"]
    s = res["asleep"]
    return "\n".join([
        f"offload / onload, {res['model']} ({res['policy']} policy, {res['backend']}), {res['gpu']}, medians:",
        "| step | s | pinned-PCIe floor s | × floor |",
        "|---|---|---|---|",
        f"| sleep ({moved:.1f} GiB to the host) | {res['sleep_s']:.3f} | {f['sleep']:.3f} | {res['sleep_s'] / f['sleep']:.2f} |",
        f"| wake_up ({moved:.1f} GiB back) | {res['wake_up_s']:.3f} | {f['wake_up']:.3f} | {res['wake_up_s'] / f['wake_up']:.2f} |",
        f"| both | {both:.3f} | {floor:.3f} | {both / floor:.2f} |",
        f"pinned PCIe: {res['pcie_gbps']['d2h']:.1f} GB/s device→host, {res['pcie_gbps']['h2d']:.1f} GB/s host→device",
        f"a sleep in two halves (a weight sync between them): {res['first_half_s']:.3f} s + {res['second_half_s']:.3f} s",
        f"GPU while asleep: {s['device_used_gib']:.2f} GiB used on the device (awake {res['awake']['device_used_gib']:.2f}), "
        f"allocator reserved {s['reserved_gib']:.2f} GiB, allocated {s['allocated_gib']:.3f} GiB (paused regions count "
        f"as allocated); without its process groups {res['asleep_without_process_groups']['device_used_gib']:.2f} GiB; "
        f"a bare process (CUDA context + one cuBLAS matmul) {res['bare_process']:.2f} GiB",
    ])  # fmt: skip


if __name__ == "__main__":
    main()
