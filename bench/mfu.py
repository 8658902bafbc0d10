"""Model FLOPs of a training step, counted the usual way (PaLM, appendix B; Megatron-LM): matmul FLOPs only.

    train FLOPs = 6 · (N − V·h) · T + 6 · L · h · s · T

N parameters, of which the input embedding's V·h are a table lookup, not a matmul (the output projection is a
matmul and stays; with tied embeddings the one table *is* the projection, so nothing is subtracted); T tokens,
L layers, h hidden, s the length of each causal sample: attention's QKᵀ and AV are 2·2·s·h FLOPs per token and
layer, half of that under the causal mask, ×3 for forward + backward. Norms, biases, RoPE and the loss count as
nothing. MFU = train FLOPs / (step seconds · peak), peak 989e12 (H100/H200 dense bf16).

Until 2026-12-03 `bench/gpu_train.py` counted 6·N·T, the embedding included (+18% FLOPs on the 1.84B shape,
+34% on the 0.5B); this module is the one count now. Run as a script it recounts the recorded results:

    .venv/bin/python -m bench.mfu bench/results/gpu_train.json bench/results/mfu_gpu_1.8B_s1.json \
        bench/results/mfu_gpu_1.8B_s4.json --out bench/results/mfu_recount.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

PEAK = 989e12
SHAPES = {
    # Qwen2-shaped models (hidden, layers, heads, kv heads, ffn, vocab), untied embeddings
    "1.8B": (2048, 24, 16, 16, 5504, 151936),
    "0.5B": (1024, 24, 16, 16, 2816, 151936),
}


def train_flops(
    n_params: int, *, vocab: int, hidden: int, layers: int, sample_len: int, tokens: int, tied: bool = False
) -> float:
    """Matmul FLOPs of forward + backward over `tokens` tokens in causal samples of `sample_len`."""
    matmul_params = n_params if tied else n_params - vocab * hidden
    return 6.0 * matmul_params * tokens + 6.0 * layers * hidden * sample_len * tokens


def flops_of_row(row: dict[str, Any]) -> float:
    """The train FLOPs of one recorded `bench/gpu_train.py` configuration (one optimizer step)."""
    hidden, layers, _, _, _, vocab = SHAPES[row["model"]]
    sample_len = row["seq"] // row.get("samples_per_mb", 1)
    tokens = row["seq"] * row.get("micro_batches", 1)
    return train_flops(row["params"], vocab=vocab, hidden=hidden, layers=layers, sample_len=sample_len, tokens=tokens)


def recount(row: dict[str, Any]) -> dict[str, Any]:
    """The row's MFU counted by `train_flops`, beside what was recorded (same measured step time)."""
    flops = flops_of_row(row)
    out = {k: row.get(k) for k in ("model", "variant", "loss", "adam", "micro_batches", "seq", "samples_per_mb")}
    out["tokens_per_s"] = row["tokens_per_s"]
    out["mfu_recorded"] = row["mfu"]
    out["mfu"] = flops / row["step_s_median"] / PEAK
    if "mfu_fwd_bwd_only" in row:
        fwd_bwd = row.get("forward_backward_s") or (row["forward_s"] + row["backward_s"])
        out["mfu_fwd_bwd_only"] = flops / fwd_bwd / PEAK
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="JSON written by bench/gpu_train.py (a row or a list of rows)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for path in a.results:
        data = json.loads(Path(path).read_text())
        for r in data if isinstance(data, list) else [data]:
            rows.append({"source": path, **recount(r)})
    print(
        f"{'source':<38} {'model':>5} {'variant':>8} {'mb':>3} {'samples':>7} {'tok/s':>7} {'recorded':>9} {'MFU':>6}"
    )
    for r in rows:
        samples = f"{r['samples_per_mb'] or 1}x{r['seq'] // (r['samples_per_mb'] or 1)}"
        print(
            f"{Path(r['source']).name:<38} {r['model']:>5} {r['variant'] or '-':>8} {r['micro_batches'] or 1:>3} "
            f"{samples:>7} {r['tokens_per_s']:>7.0f} {r['mfu_recorded']:>9.1%} {r['mfu']:>6.1%}"
        )
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
