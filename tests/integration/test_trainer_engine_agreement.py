"""Trainer and engine agree (issue 4): the trainer's recomputed log-probs equal the engine's, before and after
the first weight sync, and both sides hash to the same weights after every sync.

One real `MegatronTrainer` rank (CPU, gloo, world 1, a spawned process) drives one fake SGLang `hf` engine
(a subprocess) exactly as the train loop does: initial sync (version 0) → rollout at temperature 0.7 through
slime's own `generate` → `trainer.train` (log-probs recomputed: no `--use-rollout-logprobs`) → sync
(version 1) → rollout → `trainer.train`. The trainer's new metric `train/train_rollout_logprob_abs_diff_max`
is checked against an independent per-token comparison, and a negative control shows the comparison has
teeth: the second rollout's engine log-probs are far from those of the initial weights, so agreement after
the sync proves the engine serves the trained weights. The fake's request log must show each sync as
pause → flush → load (several buckets) → flush → continue, then the `/weights_checker` call.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

from slime.utils.http_utils import find_free_port

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

SHIM = "sim.fake_megatron.cpu_shim.apply"
TEMPERATURE = 0.7
TOL = 1e-3
BUCKET = 64 * 1024  # small buckets: every sync sends several /update_weights_from_tensor calls
PROMPTS = ["Reverse the digits: 4817263", "What is the answer? The answer is", "def main(): return"]
N_SAMPLES = 4


def _build_checkpoint(out: Path) -> Path:
    """The quick-start tiny model with weights scaled up, so log-probs are far from uniform at T=0.7."""
    from transformers import AutoModelForCausalLM

    from sim.tiny_checkpoint import build_tiny_checkpoint

    path = build_tiny_checkpoint(out)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
    model.save_pretrained(path)
    return path


def _rollout(args, rollout_id: int, first_index: int) -> list:
    """N_SAMPLES trajectories per prompt through slime's production `generate` (engine URL as the router)."""
    from slime.rollout.generate import base_sampling_params, derive_sampling_seed, generate
    from slime.utils.async_utils import run
    from slime.utils.types import Sample, Status

    samples = []
    for p, text in enumerate(PROMPTS):
        for _ in range(N_SAMPLES):
            i = first_index + len(samples)
            seed = derive_sampling_seed(args.rollout_seed, rollout_id, i)
            samples.append(
                Sample(index=i, group_index=first_index + p, prompt=text, status=Status.PENDING,
                       metadata={"sampling_seed": seed})
            )  # fmt: skip
    params = base_sampling_params(args)

    async def go():
        import asyncio

        return await asyncio.gather(*(generate(args, s, params) for s in samples))

    run(go())
    rng = random.Random(rollout_id)
    for s in samples:
        assert s.rollout_log_probs and len(s.rollout_log_probs) == s.response_length > 0
        s.reward = rng.random()  # any reward with within-group variance gives a gradient
    return samples


def _per_token_diff(trainer, data: dict) -> tuple[float, int]:
    """Independent check: the trainer's π_old recompute (same micro-batches as `train`) vs the engine, per token."""
    from slime.backends.megatron.microbatch import microbatches

    mbs = microbatches(data)
    trainer._compute_logprobs(mbs, "log_probs")
    worst, count = 0.0, 0
    for mb in mbs:
        for lp, roll, mask in zip(mb.log_probs, mb.rollout_log_probs, mb.loss_masks, strict=True):
            assert len(lp) == len(roll) == len(mask)
            keep = torch.tensor(mask) > 0
            d = (lp.double() - torch.tensor(roll, dtype=torch.float64)).abs()[keep]
            worst, count = max(worst, float(d.max())), count + int(keep.sum())
    return worst, count


def _initial_weights_diff(ckpt: str, samples: list) -> float:
    """Negative control: engine log-probs vs those of the *initial* weights (an HF model of the checkpoint)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for s in samples:
            logits = model(torch.tensor([s.tokens])).logits[0].float() / TEMPERATURE
            lp = torch.log_softmax(logits, dim=-1)
            n = s.response_length
            targets = torch.tensor(s.tokens[-n:])
            mine = lp[len(s.tokens) - n - 1 : len(s.tokens) - 1].gather(-1, targets[:, None])[:, 0]
            worst = max(worst, float((mine - torch.tensor(s.rollout_log_probs)).abs().max()))
    return worst


def _worker(rank: int, ckpt: str, engine_url: str, port: int, out: str) -> None:
    from slime.arguments import parse_args
    from slime.backends.megatron.trainer import MegatronTrainer
    from slime.backends.megatron.weight_hash import check_engines, overall_checksum, trainer_weight_checksums
    from slime.backends.megatron.weight_sync import TensorWeightSync
    from slime.ray.train_data import build_rank_data
    from slime.scheduling.carry import CarryBuffer

    torch.set_num_threads(1)
    host, engine_port = engine_url.removeprefix("http://").split(":")
    args = parse_args([
        "--hf-checkpoint", ckpt, "--rollout-batch-size", str(len(PROMPTS)), "--n-samples-per-prompt", str(N_SAMPLES),
        "--num-rollout", "2", "--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-temperature", str(TEMPERATURE), "--rollout-max-response-len", "12",
        "--lr", "1e-2", "--custom-megatron-init-path", SHIM, "--update-weight-buffer-size", str(BUCKET),
    ])  # fmt: skip
    args.sglang_router_ip, args.sglang_router_port = host, int(engine_port)  # no router: talk to the engine
    trainer = MegatronTrainer(args, rank, 1, "127.0.0.1", port)
    sync = TensorWeightSync([engine_url], BUCKET)  # one sender: the URL alone names the engine
    res: dict = {"syncs": [], "steps": []}

    def push(version: int) -> None:
        sent = sync.sync(trainer.export_hf(), version)
        sums = trainer_weight_checksums(trainer)
        checked = check_engines([engine_url], sums)  # raises WeightMismatch on any differing tensor
        res["syncs"].append({"version": version, **sent, **checked, "checksum": overall_checksum(sums)})

    push(0)  # as train.py does before the first rollout
    carry = CarryBuffer()
    for rollout_id in range(2):
        samples = _rollout(args, rollout_id, first_index=100 * rollout_id)
        rank_data, _ = build_rank_data(args, rollout_id, samples, carry, {"dp_size": 1, "cp_size": 1})
        data = rank_data[0]
        worst, count = _per_token_diff(trainer, data)
        metrics = trainer.train(rollout_id, data)
        res["steps"].append({
            "per_token_max": worst, "num_tokens": count,
            "metric_max": metrics["train/train_rollout_logprob_abs_diff_max"],
            "metric_mean": metrics["train/train_rollout_logprob_abs_diff"],
            "grad_norm": metrics["train/grad_norm"],
            "weight_versions": sorted({v for s in samples for v in s.weight_versions}),
            "initial_weights_max": _initial_weights_diff(ckpt, samples),
        })  # fmt: skip
        push(rollout_id + 1)
    with open(out, "w") as f:
        json.dump(res, f)

    from slime.backends.megatron.initialize import destroy_megatron

    destroy_megatron()


@pytest.fixture(scope="module")
def agreement(tmp_path_factory):
    import torch.multiprocessing as mp

    from sim.fake_sglang.testing import launch_fake_sglang

    root = tmp_path_factory.mktemp("agreement")
    ckpt = _build_checkpoint(root / "model")
    log = root / "requests.jsonl"
    out = root / "result.json"
    engine_args = ["--engine", "hf", "--model-path", str(ckpt), "--request-log", str(log)]
    with launch_fake_sglang(engine_args) as server:
        # A plain blocking join (waitpid): torch's spawn helper waits on a pipe that torch_shm_manager, started
        # by the worker's file_system tensor sharing, inherits and keeps open while the engine holds shm handles.
        proc = mp.get_context("spawn").Process(
            target=_worker, args=(0, str(ckpt), server.url, find_free_port(), str(out))
        )
        proc.start()
        try:
            proc.join()
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join()
        assert proc.exitcode == 0, f"trainer worker exited with {proc.exitcode}"
        import httpx

        final = httpx.post(f"{server.url}/weights_checker", json={"action": "checksum"}, timeout=60).json()
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return {"result": json.loads(out.read_text()), "log": records, "final": final}


def test_logprobs_agree_before_and_after_the_first_sync(agreement):
    steps = agreement["result"]["steps"]
    assert len(steps) == 2
    for i, s in enumerate(steps):
        assert s["num_tokens"] >= len(PROMPTS) * N_SAMPLES
        assert s["per_token_max"] < TOL, (i, s)
        # the train step's own metric sees the same per-token maximum (same recompute, same micro-batches)
        assert s["metric_max"] < TOL and abs(s["metric_max"] - s["per_token_max"]) < 1e-6, (i, s)
        assert s["metric_mean"] <= s["metric_max"] + 1e-12
        assert s["grad_norm"] > 0
        assert s["weight_versions"] == [str(i)]  # rollout i was generated by weight version i
    # negative control: at step 0 the engine serves the initial weights; after the sync it no longer does
    assert steps[0]["initial_weights_max"] < TOL
    assert steps[1]["initial_weights_max"] > 50 * TOL, steps[1]


def test_weight_hashes_equal_after_every_sync(agreement):
    syncs = agreement["result"]["syncs"]
    assert [s["version"] for s in syncs] == [0, 1, 2]
    for s in syncs:
        assert s["weight_sync/checked_engines"] == 1 and s["weight_sync/checked_tensors"] > 10
        assert s["weight_sync/buckets"] > 1
    assert len({s["checksum"] for s in syncs}) == 3  # every train step changed the weights
    final = agreement["final"]
    assert final["success"] and len(final["ranks"]) == 1
    from slime.backends.megatron.weight_hash import overall_checksum

    # the engine, asked from outside after the run, still holds exactly the last weights the trainer sent
    assert overall_checksum(final["ranks"][0]["checksums"]) == final["ranks"][0]["per_gpu_checksum"]
    assert final["ranks"][0]["per_gpu_checksum"] == syncs[-1]["checksum"]


def test_request_log_shows_pause_flush_load_continue(agreement):
    control = {"/pause_generation", "/flush_cache", "/update_weights_from_tensor", "/continue_generation"}
    seq = [r["endpoint"] for r in agreement["log"] if r["endpoint"] in control | {"/weights_checker", "/generate"}]
    assert all(r["status"] == 200 for r in agreement["log"] if r["endpoint"] in control | {"/weights_checker"})
    syncs, cur = [], None
    for ep in seq:
        if ep == "/pause_generation":
            assert cur is None, seq
            cur = [ep]
        elif ep in control:
            assert cur is not None, f"{ep} outside a pause/continue window: {seq}"
            cur.append(ep)
            if ep == "/continue_generation":
                syncs.append(cur)
                cur = None
        else:
            assert cur is None, f"{ep} while the engine was paused: {seq}"
    assert len(syncs) == 3
    for s in syncs:
        loads = s[2:-1]
        # one flush, while paused and before the loads: nothing can fill the cache again before continue
        assert s[:2] == ["/pause_generation", "/flush_cache"], s
        assert s[-1] == "/continue_generation", s
        assert len(loads) > 1 and set(loads) == {"/update_weights_from_tensor"}, s
    # each sync is followed by the hash check before the next rollout's first /generate
    after = [ep for ep in seq if ep in ("/continue_generation", "/weights_checker", "/generate")]
    for i, ep in enumerate(after):
        if ep == "/continue_generation":
            assert after[i + 1] == "/weights_checker", after
    versions = [
        r["body"].get("weight_version") for r in agreement["log"] if r["endpoint"] == "/update_weights_from_tensor"
    ]
    assert sorted(set(versions)) == ["0", "1", "2"]


if __name__ == "__main__":  # pragma: no cover - manual run
    sys.exit(pytest.main([__file__, "-q"]))
