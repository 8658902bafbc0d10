"""Engine fault tolerance: 3 fake engines behind the real router under Ray; during a 64-sample rollout one
engine is SIGKILLed (or hung: process alive, health check silent) at a random moment.

Each repetition checks: all 64 indices come back exactly once and COMPLETED; each sample's tokens are one
engine's complete answer (request logs of every engine); the faulty engine leaves the router's `/workers`
and is back, re-registered, after `recover()` (what the trainer calls before the next weight sync).
`FT_REPS` sets the repetitions (5 in CI; ci/fault_tolerance.sh runs 20 and records the result).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import ray

from slime.arguments import default_args
from slime.ray.placement import create_placement_group, init_ray
from slime.ray.rollout_servers import RolloutServers
from slime.rollout.generate import GenerateState, base_sampling_params, generate
from slime.utils.types import Sample, Status

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

REPS = int(os.environ.get("FT_REPS", "5"))
N = 64
INTERVAL, TIMEOUT = 0.5, 1.5


def cluster_args(tmp: Path) -> argparse.Namespace:
    cfg = tmp / "synthetic.yaml"
    cfg.write_text("output_len: {dist: uniform, low: 20, high: 40}\ntoken_latency_s: {dist: fixed, value: 0.02}\n")
    (tmp / "logs").mkdir()
    return default_args(
        hf_checkpoint=str(tmp), seed=1, rollout_engine="sim", sim_engine="synthetic",
        sim_synthetic_config=str(cfg), sim_request_log_dir=str(tmp / "logs"), rollout_num_gpus=3,
        actor_num_gpus_per_node=3, debug_rollout_only=True, offload_rollout=False, router_policy="round_robin",
        use_fault_tolerance=True, rollout_health_check_interval=INTERVAL, rollout_health_check_timeout=TIMEOUT,
        rollout_health_check_first_wait=0.0, sglang_router_request_timeout_secs=600, rollout_max_response_len=64,
    )  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ft")
    args = cluster_args(tmp)
    init_ray(args)
    servers = None
    try:
        servers = RolloutServers(args, create_placement_group(args), str(tmp / "servers"))
        servers.start()
        yield args, servers, tmp / "logs"
    finally:
        if servers is not None:
            servers.dispose()
        ray.shutdown()


def rollout(args, rep: int) -> list[Sample]:
    async def run() -> list[Sample]:
        params = base_sampling_params(args)
        samples = []
        for i in range(N):
            s = Sample(index=i, prompt="", tokens=[rep + 1, i + 1, 7], metadata={"sampling_seed": rep * 1000 + i})
            samples.append(s)
        GenerateState.get(args).reset()
        return list(
            await asyncio.gather(
                *(generate(args, s, dict(params, sampling_seed=s.metadata["sampling_seed"])) for s in samples)
            )
        )

    return asyncio.run(run())


def completed_answers(log_dir: Path) -> dict[int, list[tuple[str, list[int]]]]:
    """sampling_seed -> [(engine log, output_ids)] of every /generate that an engine answered in full."""
    out: dict[int, list[tuple[str, list[int]]]] = {}
    for f in log_dir.glob("engine_*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if r["endpoint"] != "/generate" or r["status"] != 200:
                continue
            seed = r["body"]["sampling_params"].get("sampling_seed")
            for resp in r.get("responses", []):
                if resp["finish_reason"]["type"] != "abort":
                    out.setdefault(seed, []).append((f.name, resp["output_ids"]))
    return out


def wait_until(cond, what: str, limit: float) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_engine_fault_mid_rollout(cluster, fault):
    args, servers, log_dir = cluster
    router = servers.routers[servers.plan.routers[0].model]
    rng = random.Random(fault)
    for rep in range(REPS):
        rep_id = rep + (0 if fault == "kill" else 100)
        victim = rng.choice(servers.slots)
        url, pid = victim.url, victim.pid
        result: dict = {}
        t = threading.Thread(target=lambda r=result, k=rep_id: r.setdefault("samples", rollout(args, k)))
        t.start()
        time.sleep(rng.uniform(0.1, 0.8))  # a random moment of the rollout
        if fault == "kill":
            os.kill(pid, signal.SIGKILL)
        else:
            assert httpx.post(f"{url}/_fault", json={"mode": "hang"}, timeout=5).status_code == 200
        t.join(timeout=300)
        assert not t.is_alive(), "rollout did not finish"
        samples = result["samples"]
        assert sorted(s.index for s in samples) == list(range(N))
        assert all(s.status == Status.COMPLETED for s in samples), [s.status for s in samples]
        answers = completed_answers(log_dir)
        for s in samples:
            got = answers[s.metadata["sampling_seed"]]
            # the response is one engine's complete answer: a splice of a dead engine's partial output and a
            # retry would match no logged answer
            assert s.tokens[:3] == [rep_id + 1, s.index + 1, 7]
            assert s.tokens[3:] in [ids for _, ids in got] and s.response_length == len(s.tokens) - 3
        # the faulty engine leaves the router (within interval + timeout, plus the monitor's own round trip)
        wait_until(lambda u=url: u not in {w["url"] for w in router.list_workers()}, "dead engine still listed", 30)
        assert not victim.alive and url in servers.removed_urls
        assert servers.recover() == 1  # "before the next weight sync"
        workers = router.list_workers()
        assert len(workers) == 3 and all(w["is_healthy"] for w in workers)
        assert victim.alive and victim.url in {w["url"] for w in workers}
        synced = servers.weight_sync_engines()
        assert len(synced) == 3 and victim.url in {e["url"] for e in synced}
