"""A reference policy served by SGLang (`--ref-model-name`) gives the trainer-side reference's numbers; a
Megatron OPD teacher identical to the student contributes exactly nothing, and a different one (`--opd-teacher-load`
of the reference checkpoint) gives HF's log-probs of that checkpoint, which reach the advantages and the loss.

A fake `hf` engine serves the reference checkpoint; the rollout-side scorer (slime/rollout/model_scoring.py) asks
it for the response log-probs. One spawned CPU/gloo rank then builds two trainers on the same samples: one keeps
the reference on the trainer (`--ref-load`), one reads the served log-probs from the train data. Their reference
log-probs agree within 1e-5 (fp32) and their KL losses match.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from sim.rank_spawn import spawn_ranks
from slime.utils.http_utils import find_free_port

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

SHIM = "sim.fake_megatron.cpu_shim.apply"


def _samples(vocab: int) -> list:
    from slime.utils.types import Sample, Status

    rng = random.Random(0)
    out = []
    for i in range(8):
        r = rng.randint(2, 6)
        tokens = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 8) + r)]
        out.append(Sample(group_index=i // 2, index=i, group_id=i, tokens=tokens, response_length=r,
                          reward=rng.random(), status=Status.COMPLETED))  # fmt: skip
    return out


def _worker(rank: int, port: int, student: str, ref: str, served: str, out: str) -> None:
    import torch

    from slime.arguments import parse_args
    from slime.backends.megatron.initialize import destroy_megatron
    from slime.backends.megatron.trainer import MegatronTrainer
    from slime.ray.train_data import build_rank_data
    from slime.scheduling.carry import CarryBuffer
    from slime.utils.types import Sample

    torch.set_num_threads(1)
    served_ref = json.loads(Path(served).read_text())
    common = [
        "--hf-checkpoint", student, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--global-batch-size", "8", "--num-rollout", "1", "--rollout-num-gpus", "1", "--actor-num-gpus-per-node",
        "1", "--lr", "1e-3", "--custom-megatron-init-path", SHIM, "--use-kl-loss", "--kl-loss-coef", "0.5",
        "--kl-loss-type", "k3", "--use-opd", "--opd-type", "megatron", "--opd-teacher-load", student,
    ]  # fmt: skip
    result: dict = {}
    modes = (
        ("trainer", ["--ref-load", ref]),
        ("served", ["--ref-model-name", "ref"]),
        ("teacher", ["--ref-load", ref, "--opd-teacher-load", ref]),  # a teacher other than the student (last wins)
    )
    for mode, extra in modes:
        args = parse_args([*common, *extra])
        trainer = MegatronTrainer(args, rank, 1, "127.0.0.1", port)
        samples = [Sample.from_dict(d) for d in json.loads(Path(served).with_suffix(".samples").read_text())]
        if mode == "served":
            for s, lp in zip(samples, served_ref, strict=True):
                s.ref_log_probs = lp
        data, _ = build_rank_data(args, 0, samples, CarryBuffer(), {"dp_size": 1, "cp_size": 1})
        seen: dict = {}
        original = trainer._prepare_batch

        def spy(mb, original=original, seen=seen):
            original(mb)
            for key in ("log_probs", "ref_log_probs", "teacher_log_probs", "advantages"):
                seen.setdefault(key, {}).update({i: getattr(mb, key)[p].tolist() for p, i in enumerate(mb.indices)})

        trainer._prepare_batch = spy
        metrics = trainer.train(0, data[0])
        result[mode] = {"kl_loss": metrics["train/kl_loss"], "opd_reverse_kl": metrics["train/opd_reverse_kl"],
                        "has_ref_copy": "ref" in trainer.frozen, "rewards": data[0]["rewards"],
                        "positions": data[0]["batch_positions"], **seen}  # fmt: skip
        destroy_megatron()
        port = find_free_port()
    Path(out).write_text(json.dumps(result))


def test_served_reference_equals_trainer_reference_and_identical_teacher_is_zero(tmp_path):
    from sim.fake_sglang.testing import launch_fake_sglang
    from sim.tiny_checkpoint import build_tiny_checkpoint
    from slime.arguments import default_args
    from slime.rollout.model_scoring import score_responses
    from slime.utils.http_utils import close_session

    student = str(build_tiny_checkpoint(tmp_path / "student"))
    ref = str(build_tiny_checkpoint(tmp_path / "ref", seed=1))
    from transformers import AutoConfig

    samples = _samples(AutoConfig.from_pretrained(student).vocab_size)
    with launch_fake_sglang(["--engine", "hf", "--model-path", ref]) as server:
        args = default_args(ref_model_name="ref", use_kl_loss=True)
        args.sglang_model_routers = {"ref": server.url}

        async def score():
            try:
                return await score_responses(args, "ref", samples)
            finally:
                await close_session()

        served = asyncio.run(score())
    assert [len(x) for x in served] == [s.response_length for s in samples]
    served_path = tmp_path / "served.json"
    served_path.write_text(json.dumps(served))
    served_path.with_suffix(".samples").write_text(
        json.dumps([s.to_dict() | {"status": "completed"} for s in samples])
    )
    out = tmp_path / "result.json"
    spawn_ranks(_worker, args=(find_free_port(), student, ref, str(served_path), str(out)), nprocs=1)
    r = json.loads(out.read_text())
    trainer, via_sglang = r["trainer"], r["served"]
    assert trainer["has_ref_copy"] and not via_sglang["has_ref_copy"]  # the served reference keeps no copy
    for i, lp in trainer["ref_log_probs"].items():
        assert max(abs(a - b) for a, b in zip(lp, via_sglang["ref_log_probs"][i], strict=True)) < 1e-5
        # the served numbers reached the trainer unchanged
        assert via_sglang["ref_log_probs"][i] == pytest.approx(served[trainer["positions"][int(i)]], abs=1e-7)
    assert trainer["kl_loss"] > 1e-3 and abs(trainer["kl_loss"] - via_sglang["kl_loss"]) < 1e-5
    # OPD with the student's own checkpoint as teacher: identical log-probs, so advantages are the bare rewards
    for mode in (trainer, via_sglang):
        for i, adv in mode["advantages"].items():
            assert mode["teacher_log_probs"][i] == mode["log_probs"][i]
            assert len(set(adv)) == 1 and adv[0] == pytest.approx(mode["rewards"][int(i)], abs=1e-7)  # fp32
        assert abs(mode["opd_reverse_kl"]) < 1e-6
    # a different teacher: its log-probs are HF's of that checkpoint (the fake engine's transformers forward), they
    # differ from the student's, and each token's advantage moves by exactly -(ℓ_student − ℓ_teacher)
    teacher = r["teacher"]
    moved = 0.0
    for i, adv in teacher["advantages"].items():
        lp, tlp = teacher["log_probs"][i], teacher["teacher_log_probs"][i]
        assert tlp == pytest.approx(served[teacher["positions"][int(i)]], abs=1e-5)
        assert lp == pytest.approx(trainer["log_probs"][i], abs=1e-7)  # the student is unchanged
        for a, s_lp, t_lp in zip(adv, lp, tlp, strict=True):
            assert a == pytest.approx(teacher["rewards"][int(i)] - (s_lp - t_lp), abs=1e-5)
            moved = max(moved, abs(s_lp - t_lp))
    assert moved > 1e-2  # the teacher really differs, so the checks above are not the identical case again
    assert abs(teacher["opd_reverse_kl"]) > 1e-3  # and the term reached the train step's metrics
