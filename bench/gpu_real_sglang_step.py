"""The colocated GRPO step of the ~1.2B Qwen2 shape on one GPU with a real SGLang engine, phase by phase, and its
weight sync against the bare CUDA-IPC hand-off of the same bytes measured in the same run.

The command of docs/performance.md's per-phase section (32 samples of up to 16 tokens per step), with
`--rollout-engine sglang`: the table is the `time/*` and `weight_sync/*` metrics of each rollout; the floor is
`bench.gpu_weight_sync.bare_handoff` (one process hands the other a CUDA IPC handle of a buffer that size and
the other copies it into its own), run after the training job has ended so both have the GPU to themselves.

    export PYTHONPATH=$PWD/.gpu-site:$PWD
    python -m bench.gpu_real_sglang_step --work /tmp/m12 --sglang-python .sgl-site/bin/python \\
        --out $OUT/gpu_real_sglang_step.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench.gpu_sglang_serving import ROOT, prepare_model
from bench.gpu_trainer import log, median, write_json

COLUMNS = [
    ("step s", "time/step"), ("rollout", "time/rollout"), ("engine release", "time/engine_release"),
    ("train call", "time/train_total"), ("↳ wake-up", "time/actor_wake_up"), ("↳ log-probs", "time/log_probs"),
    ("↳ train", "time/train"), ("↳ sleep", "time/actor_sleep"), ("weight sync", "time/weight_sync"),
    ("↳ sync itself", "weight_sync/total_s"), ("engine resume", "time/engine_resume"),
    ("unaccounted", "time/unaccounted"),
]  # fmt: skip


def run(a: argparse.Namespace, model: Path) -> list[dict[str, float]]:
    from sim.slime_run import run_slime_train

    out = Path(a.work) / "step_run"
    argv = [
        "--hf-checkpoint", str(model), "--prompt-data", str(model.parent / "data" / "train.jsonl"),
        "--input-key", "input", "--label-key", "label", "--apply-chat-template",
        "--custom-rm-path", "examples.toy.reward.reverse_digits_rm", "--rollout-engine", "sglang",
        "--sglang-python", a.sglang_python, "--sglang-attention-backend", "triton",
        "--sglang-sampling-backend", "pytorch", "--sglang-mem-fraction-static", "0.5",
        "--colocate", "--bf16", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "32",
        "--num-rollout", str(a.rollouts), "--rollout-max-response-len", "16", "--lr", "1e-6",
        "--update-weight-buffer-size", str(a.bucket_mb * 2**20), "--metrics-dir", str(out), "--no-use-tensorboard",
    ]  # fmt: skip
    log(f"slime train, colocated with SGLang, {a.rollouts} rollouts")
    code = run_slime_train(argv, out.with_suffix(".log"), timeout=a.timeout)
    if code != 0:
        raise SystemExit(f"slime train exited {code}: {out.with_suffix('.log').read_text()[-4000:]}")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["metrics"] for r in records if r["kind"] == "train"]


def table(steps: list[dict[str, float]]) -> str:
    head = "| rollout | " + " | ".join(c for c, _ in COLUMNS) + " |"
    rows = [head, "|---|" + "---|" * len(COLUMNS)]
    for i, m in enumerate(steps):
        cells = [f"{m[k]:.3f}" if k in m else "—" for _, k in COLUMNS]
        rows.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True)
    p.add_argument("--sglang-python", default=str(ROOT / ".sgl-site" / "bin" / "python"))
    p.add_argument("--rollouts", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--timeout", type=float, default=480)
    p.add_argument("--out", default="bench/results/gpu_real_sglang_step.json")
    a = p.parse_args(argv)
    import platform

    import torch

    from bench.gpu_weight_sync import bare_handoff

    model = prepare_model(Path(a.work))
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "host": platform.node(),
                           "date": time.strftime("%Y-%m-%d %H:%M"), "model": "1.2B (hidden 2048, 24 layers)",
                           "bucket_mb": a.bucket_mb}  # fmt: skip
    steps = run(a, model)
    res["steps"] = steps
    res["table"] = table(steps)
    print(res["table"])
    write_json(a.out, res)
    nbytes = int(steps[-1]["weight_sync/bytes"])
    bare = bare_handoff(nbytes // 2, a.repeats)
    floor = median(bare)
    syncs = [m["weight_sync/total_s"] for m in steps[1:]]  # the first opens connections and warms the allocator
    res["bare_s"] = {"median": floor, "all": bare}
    res["sync_s"] = {"median": median(syncs), "all": syncs}
    res["sync_over_bare"] = median(syncs) / floor
    line = (f"weight sync {median(syncs) * 1e3:.1f} ms (median of {len(syncs)}) for {nbytes / 1e9:.2f} GB; bare IPC "
            f"hand-off {floor * 1e3:.2f} ms; {res['sync_over_bare']:.2f}x")  # fmt: skip
    log(line)
    res["summary"] = line
    write_json(a.out, res)
    return res


if __name__ == "__main__":
    main()
