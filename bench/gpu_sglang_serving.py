"""Generation throughput of one inference server on one GPU, for the same requests every way it is reached.

Ways (each a row of the table, tokens/s = generated tokens / wall time of the wave):
- `sglang`: a real SGLang server hit directly;
- `sglang+router`: the same server behind slime's router launcher (sglang-router), the path rollouts take;
- `slime rollout`: `slime train --debug-rollout-only` (data source, rollout, router, engine; no trainer), its
  `rollout/*` metrics: generated tokens over the rollout's wall time;
- `fake hf`: the simulated engine on CUDA (HF `generate`), what the GPU numbers of earlier stops stood on.

Requests: C concurrent `/generate` calls (C = each `--concurrency`), `--max-new-tokens` with `ignore_eos` (every
answer is that long), temperature 1, distinct prompts of ~32 tokens. The random-weight model never emits its end
token by chance often enough to matter (vocabulary of the checkpoint's tokenizer; stops are counted), so the
slime row, which sends no `ignore_eos`, generates (nearly) the same tokens.

    .sgl-site/bin/python exists (docs/offline_gpu.md); export PYTHONPATH=$PWD/.gpu-site:$PWD
    python -m bench.gpu_sglang_serving --work /tmp/m12 --concurrency 64 256 --max-new-tokens 1024 \\
        --sglang-python .sgl-site/bin/python --out $OUT/gpu_sglang_serving.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.gpu_trainer import log, write_json

ROOT = Path(__file__).resolve().parents[1]
SERVER_FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.8"]


def prepare_model(work: Path) -> Path:
    """The ~1.2B Qwen2 shape of docs/performance.md (hidden 2048, 24 layers, 16 heads, ffn 5504, the toy tokenizer)."""
    import subprocess

    if not (work / "model" / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "examples.toy.prepare", "--out", str(work), "--hidden-size", "2048",
                        "--num-layers", "24", "--num-heads", "16", "--num-kv-heads", "16", "--intermediate-size",
                        "5504", "--num-train", "512", "--num-eval", "8"], check=True, cwd=ROOT)  # fmt: skip
    return work / "model"


def prompts(n: int, model: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return [tok.encode(f"reverse the digits of {1000003 * (i + 7) % 99999989:08d} and explain each step {i}")
            for i in range(n)]  # fmt: skip


async def _wave(url: str, ids: list[list[int]], max_new: int, ignore_eos: bool) -> dict[str, float]:
    sp = {"temperature": 1.0, "max_new_tokens": max_new, "ignore_eos": ignore_eos}
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def one(i: int, p: list[int]) -> dict[str, Any]:
            body = {"input_ids": p, "sampling_params": {**sp, "sampling_seed": i}}
            async with http.post(f"{url}/generate", json=body) as r:
                r.raise_for_status()
                return await r.json()

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(ids)))
        wall = time.perf_counter() - t0
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    stops = sum(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs)
    return {"requests": len(ids), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "stops": stops}


def measure(url: str, model: Path, concurrency: list[int], max_new: int, warm: bool = True) -> dict[str, Any]:
    """One wave per concurrency (after a small warm-up wave that compiles and captures what the first one would)."""
    out: dict[str, Any] = {}
    if warm:
        asyncio.run(_wave(url, prompts(8, model), 32, True))
    for c in concurrency:
        r = asyncio.run(_wave(url, prompts(c, model), max_new, True))
        log(f"  {c} concurrent: {r['tokens']} tokens in {r['wall_s']:.1f} s = {r['tokens_per_s']:.0f} tokens/s")
        out[str(c)] = r
    return out


def sglang_rows(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    """SGLang directly, then behind slime's router launcher (the ways asked for), one server launch for both."""
    from slime.arguments import default_args
    from slime.backends.sglang.router import RouterProcess
    from slime.utils.http_utils import find_free_port
    from slime.utils.process import ManagedProcess

    port, rport = find_free_port(), find_free_port()
    argv = [a.sglang_python, "-m", "sglang.launch_server", "--model-path", str(model), "--dtype", "bfloat16",
            "--host", "127.0.0.1", "--port", str(port), "--skip-server-warmup", *SERVER_FLAGS]  # fmt: skip
    rows: dict[str, Any] = {}
    t0 = time.perf_counter()
    proc = ManagedProcess.start(argv, name="sglang", log_path=str(Path(a.work) / "sglang_serving.log"))
    router = None
    try:
        proc.wait_healthy(f"http://127.0.0.1:{port}/health_generate", timeout=600, interval=1.0)
        rows["startup_s"] = time.perf_counter() - t0
        warm = True
        if "sglang" in a.ways:
            log(f"SGLang up in {rows['startup_s']:.0f} s; directly:")
            rows["sglang"] = measure(f"http://127.0.0.1:{port}", model, a.concurrency, a.max_new_tokens)
            warm = False
        if "router" in a.ways:
            router = RouterProcess.start(default_args(), host="127.0.0.1", port=rport,
                                         log_file=str(Path(a.work) / "router_serving.log"))  # fmt: skip
            router.add_worker(f"http://127.0.0.1:{port}")
            log("through slime's router:")
            url = f"http://127.0.0.1:{rport}"
            rows["sglang+router"] = measure(url, model, a.concurrency, a.max_new_tokens, warm)
    finally:
        if router is not None:
            router.stop(grace=10)
        proc.stop(grace=20)
    return rows


def fake_rows(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    from sim.fake_sglang.testing import launch_fake_sglang

    args = ["--engine", "hf", "--model-path", str(model), "--device", "cuda", "--dtype", "bfloat16",
            "--max-running-requests", str(max(a.concurrency))]  # fmt: skip
    with launch_fake_sglang(args, timeout=600) as eng:
        log("fake hf engine:")
        return measure(eng.url, model, a.concurrency, a.max_new_tokens)


def rollout_row(a: argparse.Namespace, model: Path, concurrency: int) -> dict[str, Any]:
    """`slime train --debug-rollout-only`: one rollout of `concurrency` samples, all in flight at once."""
    from sim.slime_run import run_slime_train

    run = Path(a.work) / f"rollout_only_{concurrency}"
    n = 8
    argv = ["--hf-checkpoint", str(model), "--prompt-data", str(model.parent / "data" / "train.jsonl"),
            "--input-key", "input", "--label-key", "label", "--apply-chat-template",
            "--custom-rm-path", "examples.toy.reward.reverse_digits_rm", "--debug-rollout-only",
            "--rollout-engine", "sglang", "--sglang-python", a.sglang_python, "--rollout-num-gpus", "1",
            "--rollout-batch-size", str(concurrency // n), "--n-samples-per-prompt", str(n), "--num-rollout", "2",
            "--rollout-max-response-len", str(a.max_new_tokens), "--sglang-server-concurrency", str(concurrency),
            *[f"--sglang-{f.lstrip('-')}" if f.startswith("--") else f for f in SERVER_FLAGS],
            "--metrics-dir", str(run), "--no-use-tensorboard"]  # fmt: skip
    log(f"slime --debug-rollout-only, {concurrency} samples per rollout:")
    code = run_slime_train(argv, run.with_suffix(".log"), timeout=900)
    if code != 0:
        return {"error": f"exit {code}", "log_tail": run.with_suffix(".log").read_text()[-3000:]}
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rollout = [r["metrics"] for r in records if r["kind"] == "rollout"][-1]  # the second: the engine is warm
    step = [r["metrics"] for r in records if r["kind"] == "train"][-1]
    tokens = rollout["rollout/response_len_mean"] * rollout["rollout/num_samples"]
    wall = step["time/rollout"]  # the driver's wait for the rollout: data source, generation, rewards
    log(f"  {tokens:.0f} tokens in {wall:.1f} s = {tokens / wall:.0f} tokens/s")
    return {"requests": concurrency, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def report(res: dict[str, Any]) -> str:
    lines = ["| way | " + " | ".join(f"{c} concurrent tokens/s" for c in res["concurrency"]) + " | × SGLang |",
             "|---|" + "---|" * (len(res["concurrency"]) + 1)]  # fmt: skip
    base = res.get("sglang", {})
    for way in ("sglang", "sglang+router", "slime rollout", "fake hf"):
        if way not in res:
            continue
        cells, ratios = [], []
        for c in map(str, res["concurrency"]):
            r = res[way].get(c)
            cells.append(f"{r['tokens_per_s']:.0f}" if r and "tokens_per_s" in r else "—")
            if r and c in base and "tokens_per_s" in r:
                ratios.append(f"{r['tokens_per_s'] / base[c]['tokens_per_s']:.2f}")
        lines.append(f"| {way} | " + " | ".join(cells) + f" | {' / '.join(ratios)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True, help="directory of the model and logs (reused between runs)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--sglang-python", default=str(ROOT / ".sgl-site" / "bin" / "python"))
    ways = ["sglang", "router", "rollout", "fake"]
    p.add_argument("--ways", nargs="+", default=ways, choices=ways, help="which rows to measure (all by default)")
    p.add_argument("--out", default="bench/results/gpu_sglang_serving.json")
    a = p.parse_args(argv)
    import platform

    import torch

    model = prepare_model(Path(a.work))
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "host": platform.node(),
                           "date": time.strftime("%Y-%m-%d %H:%M"), "concurrency": a.concurrency,
                           "max_new_tokens": a.max_new_tokens, "model": "1.2B (hidden 2048, 24 layers)"}  # fmt: skip
    if {"sglang", "router"} & set(a.ways):
        res.update(sglang_rows(a, model))
        write_json(a.out, res)
    if "rollout" in a.ways:
        res["slime rollout"] = {str(c): rollout_row(a, model, c) for c in a.concurrency}
        write_json(a.out, res)
    if "fake" in a.ways:
        res["fake hf"] = fake_rows(a, model)
    res["table"] = report(res)
    write_json(a.out, res)
    print(res["table"])
    return res


if __name__ == "__main__":
    main()
