"""Colocated PPO on one GPU: host memory of the sleeping trainers per offload policy, and the memory plan's GPU peaks.

    export PYTHONPATH=$PWD/.gpu-site:$PWD; python -m bench.offload_memory_gpu --out $OUT/offload_memory_gpu.json

What it runs (one GPU with torch_memory_saver, megatron-core, Ray and sglang-router; no SGLang, no network):

1. a probe: does this machine count page-locked host memory (torch's pinned allocator, torch_memory_saver's
   backups) in a process's RSS? The host figure below is RSS plus whatever pinned bytes RSS leaves out;
2. a random-init Qwen2-shaped checkpoint (default ~1.1B parameters, bf16) built on the GPU, with the tiny
   checkpoint's tokenizer (its small vocabulary keeps the fake engine's text decoding exact);
3. the same `slime train --colocate --bf16 --advantage-estimator ppo` job (fake `hf` engine on CUDA, actor and
   critic time-sharing the GPU) twice: with the default offload policy and with `--legacy-offload`. The trainers
   log, per rollout, each phase's `torch.cuda.max_memory_allocated` and, right after going to sleep, their RSS
   and the pinned bytes their offloader holds (`memory/*` metrics);
4. the memory plan of the same configuration (slime/backends/megatron/memory.py).

It prints two tables and writes JSON (after every stage, so a run cut short still reports what it got):
- host: per role, the sleeping trainer's host bytes under each policy, the saving against 6 B × parameters
  (the acceptance: within 5%);
- GPU: per trainer phase, the measured peak against the plan's (the acceptance: within 10%).
A bench, not a test: it never asserts. Wall time about 5–8 minutes (two runs, each starting Ray and an engine);
`--budget-s` bounds it, giving the second run whatever the first left.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("critic_values", "critic_train", "actor_log_probs", "actor_train")
POLICY_FLAGS = {"default": [], "legacy": ["--legacy-offload"]}

_PROBE = r"""
import json, torch
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
n = 1 << 30
torch.cuda.init()
out = {}
r0 = rss(); x = torch.empty(n, dtype=torch.uint8, pin_memory=True); x.fill_(1); out['torch_pinned'] = (rss() - r0) / n
try:
    from torch_memory_saver import torch_memory_saver as tms
    tms.hook_mode = 'torch'
    with tms.region(tag='probe', enable_cpu_backup=True):
        y = torch.ones(n, dtype=torch.uint8, device='cuda')
    torch.cuda.synchronize(); r0 = rss(); tms.pause('probe'); out['tms_backup'] = (rss() - r0) / n; tms.resume('probe')
except Exception as e:
    out['tms_error'] = repr(e)
print(json.dumps(out))
"""


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


def probe_pinned_in_rss() -> dict[str, Any]:
    """The fraction of 1 GiB of pinned host memory that shows up in RSS, for torch's allocator and for TMS."""
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001 - a probe failure is reported, the bench goes on
        return {"error": repr(e)}


def build_checkpoint(work: Path, a: argparse.Namespace) -> Path:
    """The tiny checkpoint's tokenizer with a large random Qwen2 (bf16, initialised on the GPU, tied embeddings)."""
    from bench.gpu_trainer import build_checkpoint as build

    return build(work, a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads, a.ffn_hidden_size, tied=True)


def write_prompts(path: Path, n: int = 256) -> Path:
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(6, 10)))
            f.write(json.dumps({"input": f"Reverse the digits {digits}. Answer:", "label": digits[::-1]}) + "\n")
    return path


def job_flags(a: argparse.Namespace, model: Path, prompts: Path, metrics: Path) -> list[str]:
    precision = ["--custom-megatron-init-path", "sim.fake_megatron.cpu_shim.apply"] if a.cpu_smoke else ["--bf16"]
    return [*precision,
        "--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--input-key", "input",
        "--rm-type", "random", "--rollout-engine", "sim", "--sim-engine", "hf",
        "--colocate", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", str(a.gpus),
        "--advantage-estimator", "ppo", "--rollout-batch-size", str(a.prompts), "--n-samples-per-prompt", "2",
        "--global-batch-size", str(2 * a.prompts), "--num-rollout", str(a.rollouts),
        "--rollout-max-response-len", str(a.response_len), "--use-dynamic-batch-size",
        "--max-tokens-per-gpu", str(a.tokens), "--lr", "1e-6", "--seed", "1234", "--no-use-tensorboard",
        "--metrics-dir", str(metrics),
    ]  # fmt: skip


def run_job(flags: list[str], log_path: Path, timeout: float) -> dict[str, Any]:
    from sim.slime_run import slime_train

    t0 = time.perf_counter()
    rc: int | str
    with slime_train(flags, log_path) as proc:
        try:
            rc = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            rc = "timeout"  # the group is stopped on the way out of the block
    cmd = " ".join([sys.executable, "-m", "slime.cli", "train", *flags])
    return {"returncode": rc, "wall_s": round(time.perf_counter() - t0, 1), "cmd": cmd}


def last_train_metrics(metrics_dir: Path) -> dict[str, float]:
    """The last rollout's train record that holds both roles' memory metrics (steady state)."""
    best: dict[str, float] = {}
    path = metrics_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        m = rec.get("metrics", {})
        if rec.get("kind") == "train" and "memory/actor_params" in m:
            best = m
    return best


def host_bytes(m: dict[str, float], role: str, probe: dict[str, Any]) -> float | None:
    """RSS of the sleeping trainer plus the pinned bytes RSS does not show (per the probe)."""
    rss = m.get(f"memory/{role}_host_rss_asleep_bytes")
    if rss is None:
        return None
    fractions = [probe[k] for k in ("torch_pinned", "tms_backup") if isinstance(probe.get(k), float)]
    in_rss = min(1.0, max(0.0, min(fractions))) if fractions else 1.0
    return rss + (1.0 - in_rss) * m.get(f"memory/{role}_host_pinned_asleep_bytes", 0.0)


def plan_components(model: Path, a: argparse.Namespace, capacity: int) -> dict[str, Any]:
    """The plan's bytes of each trainer phase (the awake role's buffers only: the engine is another process)."""
    from slime.backends.megatron.hf_config import read_hf_config
    from slime.backends.megatron.memory import MemoryConfig, ModelShape, build_memory_plan

    shape = ModelShape.of(read_hf_config(model))
    try:  # without TransformerEngine / Apex megatron steps with torch's (foreach) AdamW: one √v temporary
        from megatron.core import optimizer as mcore_optimizer

        foreach = bool(getattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", True))
    except ImportError:
        foreach = True
    out: dict[str, Any] = {}
    for policy in ("v0.3.0", "legacy"):
        gpu = not a.cpu_smoke  # the CPU smoke run trains in fp32 with the plain optimizer
        cfg = MemoryConfig(actor=shape, critic=shape, bf16=gpu, distributed_optimizer=gpu, policy=policy,
                           colocated=True, gpu_capacity=capacity, train_tokens=a.tokens, logprob_tokens=a.tokens,
                           adam_foreach=foreach, dp=a.gpus)  # fmt: skip
        stage = build_memory_plan(cfg).stages[0]
        out[policy] = {
            "params": {r: st.params for r, st in stage.roles.items()},
            "gpu": {
                ph: sum(v for k, v in stage.phase(ph).gpu.items() if k.startswith(ph.split("_")[0] + "/"))
                for ph in PHASES
            },
            "host_asleep": {r: sum(st.host_asleep.values()) for r, st in stage.roles.items()},
        }
    return out


def report(res: dict[str, Any]) -> str:
    gib = 2**30
    lines = []
    runs = res.get("runs", {})
    plan = res.get("plan", {})
    meas = {p: r.get("metrics", {}) for p, r in runs.items()}
    lines.append("host memory of the sleeping trainers (GiB): RSS + pinned not in RSS")
    lines.append(
        f"{'role':<8}{'default':>10}{'legacy':>10}{'saving':>10}{'6 B x params':>14}{'error':>8}{'ledger saving':>15}"
    )
    for role in ("actor", "critic"):
        h = {p: host_bytes(meas.get(p, {}), role, res.get("probe", {})) for p in ("default", "legacy")}
        params = (meas.get("default") or meas.get("legacy") or {}).get(f"memory/{role}_params")
        if params is None or None in h.values():
            lines.append(f"{role:<8} (missing: see runs)")
            continue
        saving, expect = h["legacy"] - h["default"], 6 * params
        ledger = (meas["legacy"].get(f"memory/{role}_host_asleep_bytes", 0) - meas["default"].get(f"memory/{role}_host_asleep_bytes", 0))  # fmt: skip
        res.setdefault("verdict", {})[f"host_saving_{role}"] = {"measured": saving, "expected": expect,
                                                                "rel_error": saving / expect - 1}  # fmt: skip
        lines.append(f"{role:<8}{h['default'] / gib:>10.2f}{h['legacy'] / gib:>10.2f}{saving / gib:>10.2f}"
                     f"{expect / gib:>14.2f}{100 * (saving / expect - 1):>7.1f}%{ledger / gib:>15.2f}")  # fmt: skip
    lines.append("")
    lines.append("host bytes of each sleeping trainer (GiB): booked by its offloader / measured RSS+pinned / plan")
    for role in ("actor", "critic"):
        for rank in range(int(res.get("gpus", 1))):
            pre = "memory/" if rank == 0 else f"memory/rank{rank}/"
            cells = []
            for pol, plan_pol in (("default", "v0.3.0"), ("legacy", "legacy")):
                m = {k.replace(pre, "memory/", 1): v for k, v in meas.get(pol, {}).items() if k.startswith(pre)}
                booked = m.get(f"memory/{role}_host_asleep_bytes")
                seen = host_bytes(m, role, res.get("probe", {}))
                planned = plan.get(plan_pol, {}).get("host_asleep", {}).get(role)
                if booked is not None and seen is not None and planned:
                    cells.append(f"{pol} {booked / gib:.2f} / {seen / gib:.2f} / plan {planned / gib:.2f}")
                    res.setdefault("host_vs_plan", {})[f"{pol}_{role}_rank{rank}"] = {
                        "booked": booked,
                        "measured": seen,
                        "plan": planned,
                        "rel_error": booked / planned - 1,
                    }
            lines.append(f"{role:<8}rank {rank}  " + ("; ".join(cells) or "(missing)"))
    lines.append("")
    lines.append("GPU peak per trainer phase and rank (GiB): torch.cuda.max_memory_allocated vs the memory plan")
    lines.append(f"{'phase':<17}{'rank':>5}{'default':>10}{'legacy':>10}{'plan':>10}{'error':>8}")
    for ph in PHASES:
        for rank in range(int(res.get("gpus", 1))):
            key = f"memory/{ph}_peak_bytes" if rank == 0 else f"memory/rank{rank}/{ph}_peak_bytes"
            m = {p: meas.get(p, {}).get(key) for p in ("default", "legacy")}
            pv = plan.get("v0.3.0", {}).get("gpu", {}).get(ph)
            if pv is None or m["default"] is None:
                lines.append(f"{ph:<17}{rank:>5} (missing)")
                continue
            err = m["default"] / pv - 1
            suffix = "" if rank == 0 else f"_rank{rank}"
            res.setdefault("verdict", {})[f"gpu_{ph}{suffix}"] = {
                "measured": m["default"],
                "plan": pv,
                "rel_error": err,
            }
            leg = f"{m['legacy'] / gib:>10.2f}" if m["legacy"] is not None else f"{'-':>10}"
            lines.append(f"{ph:<17}{rank:>5}{m['default'] / gib:>10.2f}{leg}{pv / gib:>10.2f}{100 * err:>7.1f}%")
    v = res.get("verdict", {})
    host_ok = [abs(x["rel_error"]) <= 0.05 for k, x in v.items() if k.startswith("host")]
    gpu_ok = [abs(x["rel_error"]) <= 0.10 for k, x in v.items() if k.startswith("gpu")]
    lines.append("")
    lines.append(f"host saving within 5% of 6 B/param: {all(host_ok) if host_ok else 'n/a'}; "
                 f"GPU peaks within 10% of the plan: {all(gpu_ok) if gpu_ok else 'n/a'}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results/offload_memory_gpu.json")
    p.add_argument("--workdir", default="/tmp/slime_offload_memory_gpu")
    p.add_argument("--policies", default="default,legacy", help="comma-separated: default, legacy")
    p.add_argument("--budget-s", type=float, default=560.0, help="wall-time budget of the whole bench")
    p.add_argument("--rollouts", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8, help="prompts per rollout (2 samples each)")
    p.add_argument("--response-len", type=int, default=16)
    p.add_argument("--tokens", type=int, default=512, help="--max-tokens-per-gpu (the plan's micro-batch tokens)")
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--ffn-hidden-size", type=int, default=7168)
    p.add_argument("--num-layers", type=int, default=20)
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--gpus", type=int, default=1, help="GPUs of the colocated job (DP = this; one engine per GPU)")
    p.add_argument("--cpu-smoke", action="store_true", help="the whole pipeline on CPU with the tiny model (wiring)")
    a = p.parse_args(argv)
    t_start = time.perf_counter()
    out_path = Path(a.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "gpus": a.gpus,
        "runs": {},
    }

    def save() -> None:
        out_path.write_text(json.dumps(res, indent=1, default=str))

    import torch

    if not torch.cuda.is_available() and not a.cpu_smoke:
        res["error"] = "no CUDA device"
        save()
        print(res["error"])
        return res
    capacity = torch.cuda.get_device_properties(0).total_memory if not a.cpu_smoke else 80 * 2**30
    name = torch.cuda.get_device_properties(0).name if not a.cpu_smoke else "cpu (smoke run: numbers mean nothing)"
    res["device"] = {"name": name, "total_memory": capacity, "torch": torch.__version__}
    try:
        import torch_memory_saver  # noqa: F401

        res["torch_memory_saver"] = True
    except ImportError:
        res["torch_memory_saver"] = False  # offload would not move memory: the numbers are then meaningless
    log(f"device {name}, torch {torch.__version__}, torch_memory_saver {res['torch_memory_saver']}")
    res["probe"] = probe_pinned_in_rss() if not a.cpu_smoke else {}
    log(f"pinned memory in RSS: {res['probe']}")
    save()
    t0 = time.perf_counter()
    if a.cpu_smoke:
        from sim.tiny_checkpoint import build_tiny_checkpoint

        model = build_tiny_checkpoint(work / "tok")
    else:
        model = build_checkpoint(work, a)
    prompts = write_prompts(work / "prompts.jsonl")
    res["checkpoint_s"] = round(time.perf_counter() - t0, 1)
    res["plan"] = plan_components(model, a, capacity)
    log(
        f"checkpoint {model} ({res['plan']['v0.3.0']['params']['actor'] / 1e9:.2f}B params) in {res['checkpoint_s']} s"
    )
    save()
    policies = [x for x in a.policies.split(",") if x]
    for i, policy in enumerate(policies):
        left = a.budget_s - (time.perf_counter() - t_start)
        timeout = left / (len(policies) - i) if i + 1 < len(policies) else left
        metrics = work / f"run_{policy}"
        shutil.rmtree(metrics, ignore_errors=True)
        log(f"run {policy}: slime train (timeout {timeout:.0f} s)")
        run = run_job([*job_flags(a, model, prompts, metrics), *POLICY_FLAGS[policy]], work / f"{policy}.log", timeout)
        run["metrics"] = last_train_metrics(metrics)
        if run["returncode"] != 0 or not run["metrics"]:
            run["log_tail"] = (work / f"{policy}.log").read_text()[-4000:]
        res["runs"][policy] = run
        log(f"run {policy}: rc {run['returncode']} in {run['wall_s']} s, {len(run['metrics'])} metrics")
        save()
    text = report(res)
    res["table"] = text
    res["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    save()
    print(text)
    for policy, run in res["runs"].items():
        if "log_tail" in run:
            print(f"--- {policy} log tail ---\n{run['log_tail'][-1500:]}")
    print(f"JSON: {out_path}")
    return res


if __name__ == "__main__":
    main()
