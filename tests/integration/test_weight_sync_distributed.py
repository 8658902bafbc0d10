"""Disaggregated weight sync (issue 5): a TP=2 trainer broadcasts to two engines of different sizes.

Two real `MegatronTrainer` ranks (TP=2, CPU, gloo; spawned processes) drive the production `TrainRayActor`
code directly (no Ray) against two fake SGLang `hf` engines started as subprocesses: one of 1 "GPU" and one
of 2 (`--tp-size 2`: that fake joins the weight-update group as two ranks). Sequence: rollout 0 on the
initial weights → train → sync (version 1) → rollout 1 → train → sync (version 2). Every sync runs with
`--check-weight-update-equal`, so each engine's `/weights_checker` checksums must equal the trainer's; each
train step after a sync checks the log-prob parity metric of the trainer issue
(`train/train_rollout_logprob_abs_diff_max`) on rollouts sampled from the synced engines. The engines'
request logs give the group's world size (1 + 1 + 2) and rank offsets (1 and 2).

A fast test below runs the same HTTP protocol without megatron: a plain process broadcasts HF tensors.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import pytest
import torch

from sim.rank_spawn import spawn_ranks
from slime.utils.http_utils import find_free_port

pytestmark = pytest.mark.cpu

SHIM = "sim.fake_megatron.cpu_shim.apply"
BUCKET = 64 * 1024  # several buckets per sync
PROMPTS = [[5, 17, 42, 99, 7, 3], [11, 12, 13, 14], [40, 41, 2, 9, 9, 60, 70]]
N_SAMPLES = 2
TOL = 1e-3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    from sim.tiny_checkpoint import build_tiny_checkpoint

    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("wsd") / "model"))


@pytest.fixture(scope="module")
def engines(ckpt, tmp_path_factory):
    """Two fake engines: 1 and 2 "GPUs"; yields [(url, num_gpus, request log path)]."""
    from sim.fake_sglang.testing import launch_fake_sglang

    logs = tmp_path_factory.mktemp("wsd_logs")
    common = ["--engine", "hf", "--model-path", ckpt]
    with (
        launch_fake_sglang([*common, "--tp-size", "1", "--request-log", str(logs / "e0.jsonl")]) as a,
        launch_fake_sglang([*common, "--tp-size", "2", "--request-log", str(logs / "e1.jsonl")]) as b,
    ):
        yield [(a.url, 1, logs / "e0.jsonl"), (b.url, 2, logs / "e1.jsonl")]


def _records(path: Path, since: float = 0.0) -> list[dict]:
    """The engine's request log from `since` on (the engines are shared by this module's tests)."""
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in recs if r["ts_start"] >= since]


def _rollout(url: str, rollout_id: int, first_index: int) -> list:
    """N_SAMPLES trajectories per prompt from one engine, with the engine's log-probs (temperature 1)."""
    import httpx

    from slime.rollout.generate import derive_sampling_seed
    from slime.utils.types import Sample, Status

    samples, rng = [], random.Random(rollout_id)
    for p, prompt in enumerate(PROMPTS):
        for _ in range(N_SAMPLES):
            i = first_index + len(samples)
            body = {
                "input_ids": prompt,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True,
                                    "sampling_seed": derive_sampling_seed(42, rollout_id, i)},
                "return_logprob": True,
            }  # fmt: skip
            out = httpx.post(f"{url}/generate", json=body, timeout=60).json()
            lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
            samples.append(
                Sample(index=i, group_index=first_index // N_SAMPLES + p, group_id=i, tokens=prompt + out["output_ids"],
                       response_length=len(lps), rollout_log_probs=lps, reward=rng.random(), status=Status.COMPLETED)
            )  # fmt: skip
    return samples


def _worker(rank: int, ckpt: str, engines: list, port: int, out: str) -> None:
    import torch.distributed as dist

    from slime.arguments import parse_args
    from slime.ray.train_actor import TrainRayActor
    from slime.ray.train_data import build_rank_data
    from slime.scheduling.carry import CarryBuffer

    torch.set_num_threads(1)
    n = len(PROMPTS) * N_SAMPLES
    args = parse_args([
        "--hf-checkpoint", ckpt, "--rollout-batch-size", str(len(PROMPTS)), "--n-samples-per-prompt", str(N_SAMPLES),
        "--global-batch-size", str(len(PROMPTS)), "--num-rollout", "2", "--rollout-num-gpus", "3",
        "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--lr", "1e-2",
        "--custom-megatron-init-path", SHIM, "--update-weight-buffer-size", str(BUCKET), "--check-weight-update-equal",
    ])  # fmt: skip
    assert args.update_weight_mode == "distributed"  # not colocated: chosen automatically
    actor = TrainRayActor(args, rank, 2)
    actor.init("127.0.0.1", port)
    targets = [{"url": url, "num_gpus": k} for url, k, _ in engines]
    res: dict = {"syncs": [], "train": []}
    carry = CarryBuffer()
    for rollout_id in range(2):
        box = [None]
        if rank == 0:  # half the trajectories from each engine
            url = engines[rollout_id % 2][0]
            box = [_rollout(url, rollout_id, rollout_id * n)]
        dist.broadcast_object_list(box, src=0)
        data, _ = build_rank_data(args, rollout_id, box[0], carry, {"dp_size": 1, "cp_size": 1})
        metrics = actor.backend.trainer.train(rollout_id, data[0])
        res["train"].append(metrics)
        res["syncs"].append(actor.call("update_weights", targets, rollout_id + 1))
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.barrier()
    sender = actor.backend.transport.sender
    sender.close() if sender is not None else None


@pytest.mark.slow
def test_tp2_trainer_syncs_heterogeneous_engines(ckpt, engines, tmp_path):
    out = tmp_path / "res.json"
    t0 = time.time()
    spawn_ranks(_worker, args=(ckpt, [(u, k, str(p)) for u, k, p in engines], find_free_port(), str(out)), nprocs=2)
    res = json.loads(out.read_text())
    # parity: rollout 0 on the initial weights, rollout 1 on the weights of sync 1 (from the other engine)
    for m in res["train"]:
        assert m["train/update_successful"] == 1.0
        assert m["train/train_rollout_logprob_abs_diff_max"] < TOL, m
    for s in res["syncs"]:  # --check-weight-update-equal compared both engines after each sync
        assert s["weight_sync/checked_engines"] == 2 and s["weight_sync/checked_tensors"] > 10
        assert s["weight_sync/buckets"] > 1
    inits = []
    for _, k, log in engines:
        recs = _records(log, since=t0)
        init = [r for r in recs if r["endpoint"] == "/init_weights_update_group"]
        assert len(init) == 1 and init[0]["status"] == 200  # one group, kept across both syncs
        inits.append(init[0])
        assert init[0]["tp_size"] == k and init[0]["body"]["world_size"] == 4
        assert init[0]["body"]["group_name"] == "slime-pp_0" and init[0]["body"]["backend"] == "gloo"
        loads = [r for r in recs if r["endpoint"] == "/update_weights_from_distributed"]
        assert loads and all(r["status"] == 200 and r["body"]["load_format"] == "flattened_bucket" for r in loads)
        assert all(len(set(r["member_digests"])) == 1 and len(r["member_digests"]) == k for r in loads)
        assert loads[-1]["body"]["weight_version"] == "2"
        # each sync: pause → flush → session → (group, first time) loads → end → continue → checksums
        skip = {"/generate", "/health_generate", "/init_weights_update_group", "/get_server_info", "/server_info"}
        seq = [r["endpoint"] for r in recs if r["endpoint"] not in skip]
        assert seq[-1] == "/destroy_weights_update_group"  # the sender's close() at the end
        seq = seq[:-1]
        starts = [i for i, e in enumerate(seq) if e == "/pause_generation"]
        assert len(starts) == 2
        for a, b in zip(starts, [*starts[1:], len(seq)], strict=True):
            sync = seq[a:b]
            assert sync[:3] == ["/pause_generation", "/flush_cache", "/begin_weight_update"], sync
            end = sync.index("/end_weight_update")
            assert set(sync[3:end]) == {"/update_weights_from_distributed"}
            assert sync[end:] == ["/end_weight_update", "/continue_generation", "/weights_checker"]
    # rank offsets are cumulative engine GPU counts after the trainer's rank 0
    assert [i["body"]["rank_offset"] for i in inits] == [1, 2]
    assert [i["member_ranks"] for i in inits] == [[1], [2, 3]]


def test_broadcast_protocol_without_megatron(ckpt, engines):
    """The sender alone (this process, no default group): two syncs of perturbed HF weights to both engines,
    then the engines' checksums equal the sent tensors; a changed engine set rebuilds the group."""
    from transformers import AutoModelForCausalLM

    from slime.backends.megatron.weight_hash import check_engines, hf_weight_checksums
    from slime.backends.megatron.weight_sync_distributed import (
        DistributedWeightSync,
        EngineTarget,
        rank_offsets,
    )
    from slime.backends.sglang.client import SGLangClient, begin_weight_sync, end_weight_sync

    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    targets = [EngineTarget(u, k) for u, k, _ in engines]
    assert rank_offsets(targets) == ([1, 2], 4)
    sync = DistributedWeightSync(pp_rank=3, bucket_bytes=BUCKET, timeout_s=120)
    try:
        for version in (11, 12):
            torch.manual_seed(version)
            named = [(n, p.detach() + 0.01 * torch.randn_like(p)) for n, p in model.named_parameters()]
            sync.connect(targets)
            clients = [SGLangClient(t.url) for t in targets]
            begin_weight_sync(clients)
            stats = sync.send(named, version)
            end_weight_sync(clients)
            for c in clients:
                c.close()
            assert stats["weight_sync/buckets"] > 1
            check_engines([t.url for t in targets], hf_weight_checksums(named))
        assert sync.connect(targets) == {}  # same engines: the group is reused
        info = sync.connect(targets[1:])  # a different engine set: destroy and re-create
        assert info["world_size"] == 3 and info["rank_offsets"] == [1]
        # a plan that disagrees with the engine: the engine's tp_size (ranks it will join with) wins
        info = sync.connect([EngineTarget(targets[0].url, 5)])
        assert info["world_size"] == 2
    finally:
        sync.close()
    log = _records(engines[0][2], since=t0)
    names = [r["body"].get("group_name") for r in log if r["endpoint"] == "/init_weights_update_group"]
    assert "slime-pp_3" in names
    assert any(r["endpoint"] == "/destroy_weights_update_group" and r["status"] == 200 for r in log)


def test_update_outside_a_session_is_refused(engines):
    """SGLang 0.5.23 loads weights only between /begin_weight_update and /end_weight_update."""
    import httpx

    url = engines[0][0]
    body = {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"}
    r = httpx.post(f"{url}/update_weights_from_distributed", json=body, timeout=30)
    assert r.status_code == 400 and "begin_weight_update" in r.json()["message"]
    # bodies as SGLang requires them (an empty body is refused by request validation, whatever the session)
    assert httpx.post(f"{url}/end_weight_update", json={}, timeout=30).status_code == 400
    assert httpx.post(f"{url}/begin_weight_update", json={}, timeout=30).status_code == 200
    assert httpx.post(f"{url}/begin_weight_update", json={}, timeout=30).status_code == 400
    r = httpx.post(f"{url}/update_weights_from_distributed", json=body, timeout=30)
    assert r.status_code == 400 and "init_weights_update_group" in r.json()["message"]
    assert httpx.post(f"{url}/end_weight_update", json={}, timeout=30).status_code == 200


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, *sys.argv[1:]]))
