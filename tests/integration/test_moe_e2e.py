"""A Qwen3-MoE model trains the toy task end to end with expert parallelism: `slime train` with
`--expert-model-parallel-size 2` on two train ranks, Ray, the real router and two `hf` fake engines serving the same
MoE checkpoint, 3 rollouts, the engines' per-tensor checksums (every expert under its own name) compared with the
trainer's after every weight sync (`--check-weight-update-equal`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.integration.test_toy_e2e import NUM_ROLLOUT, assets, rollout_flags, run_slime, toy_flags  # noqa: F401

pytestmark = [pytest.mark.cpu, pytest.mark.slow]


def _moe_checkpoint(assets: Path, out: Path) -> Path:  # noqa: F811
    """The toy task's tokenizer and chat template with a random Qwen3-MoE (4 experts, top 2) of its vocabulary."""
    from sim.tiny_checkpoint import build_random_moe

    toy = assets / "model"
    vocab = json.loads((toy / "config.json").read_text())["vocab_size"]
    build_random_moe(out, "qwen3_moe", vocab_size=vocab, tie_word_embeddings=True)
    for f in toy.iterdir():
        if f.suffix in (".json", ".jinja") and f.name not in ("config.json", "model.safetensors.index.json"):
            if not (out / f.name).exists():
                shutil.copy(f, out / f.name)
    return out


def test_moe_ep2_trains_the_toy_task_and_every_sync_is_exact(assets, tmp_path):  # noqa: F811
    model = _moe_checkpoint(assets, tmp_path / "moe")
    flags = toy_flags(assets)
    flags[flags.index("--actor-num-gpus-per-node") + 1] = "2"
    rollout = rollout_flags(assets)
    rollout[rollout.index("--hf-checkpoint") + 1] = str(model)
    summary, _ = run_slime(
        [*flags, *rollout, "--expert-model-parallel-size", "2", "--check-weight-update-equal"], tmp_path / "ep2"
    )
    assert sorted(int(k) for k in summary["hashes"]) == list(range(NUM_ROLLOUT))
    from safetensors.torch import load_file

    on_disk = load_file(str(model / "model.safetensors"))
    assert sum(".mlp.experts." in n for n in on_disk) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    for rid in range(NUM_ROLLOUT):
        m = summary["metrics"][str(rid)]
        assert m["train/update_successful"] == 1.0 and m["train/grad_norm"] > 0, (rid, m)
        assert m["weight_sync/buckets"] >= 1 and m["weight_sync/checked_tensors"] == len(on_disk), (rid, m)
        assert m["train/moe_load_balancing_loss"] > 0, (rid, m)
