"""End to end on real processes: the default rollout through the real sglang-router 0.3.2 in front of
`python -m sim.fake_sglang --engine scripted`. Checks the wire shapes both ways and that `abort()` reaches
the engine through the router's worker listing (the aborted group comes back with partial tokens)."""

from __future__ import annotations

import importlib.metadata
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from slime.arguments import default_args
from slime.backends.sglang.router import RouterProcess
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sglang_rollout import generate_rollout
from slime.utils.http_utils import find_free_port
from slime.utils.process import ManagedProcess
from slime.utils.types import Sample, Status

pytestmark = pytest.mark.cpu

SLOW_LEN = 400


def yes_rm(args, sample: Sample) -> float:
    return float("yes" in sample.response)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[str, int, Path, Path]]:
    from sim.tiny_checkpoint import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "tiny")
    script = tmp_path / "script.json"
    script.write_text(
        json.dumps(
            {
                "rules": [
                    {"match": "SLOW", "completion": "a" * SLOW_LEN, "finish_reason": "length"},
                    {"match": "q", "completions": ["yes", "no"]},
                ],
                "token_latency_s": 0.02,
            }
        )
    )
    log = tmp_path / "requests.jsonl"
    procs: list[ManagedProcess] = []
    router: RouterProcess | None = None
    try:
        eport, rport = find_free_port(), find_free_port()
        engine_cmd = [sys.executable, "-m", "sim.fake_sglang", "--host", "127.0.0.1", "--port", str(eport)]
        engine_cmd += ["--engine", "scripted", "--script", str(script), "--model-path", str(ckpt)]
        procs.append(ManagedProcess.start(engine_cmd + ["--request-log", str(log)], name="fake engine"))
        procs[-1].wait_healthy(f"http://127.0.0.1:{eport}/health", timeout=120)
        # slime's own router handling: add_worker returns once the router lists the engine healthy (it answers
        # /health before it has registered anything)
        router = RouterProcess.start(
            default_args(), host="127.0.0.1", port=rport, log_file=str(tmp_path / "router.log")
        )
        router.add_worker(f"http://127.0.0.1:{eport}")
        yield "127.0.0.1", rport, ckpt, log
    finally:
        if router is not None:
            router.stop(grace=10)
        for p in reversed(procs):
            p.stop(grace=10)


def test_rollout_through_real_router_and_fake_engine(tmp_path: Path, stack, make_args: Callable[..., Any]) -> None:
    ip, port, ckpt, log = stack
    # the real router, at the version slime pins, not a stand-in
    assert importlib.metadata.version("sglang-router") == "0.3.2"
    workers = httpx.get(f"http://{ip}:{port}/workers", timeout=10).json()["workers"]
    assert len(workers) == 1

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"input": p}) + "\n" for p in ["q0", "q1 SLOW", "q2", "q3"]))
    args = make_args(
        prompt_data=str(data),
        hf_checkpoint=str(ckpt),
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        over_sampling_batch_size=4,
        rollout_seed=1,
        sglang_router_ip=ip,
        sglang_router_port=port,
        rollout_max_response_len=SLOW_LEN + 10,
        custom_rm_path=f"{__name__}.yes_rm",
        partial_rollout=True,
    )
    ds = RolloutDataSourceWithBuffer(args)
    out = generate_rollout(args, 0, ds)

    assert len(out.samples) == 2 and all(len(g) == 2 for g in out.samples)
    for s in (s for g in out.samples for s in g):
        assert s.status == Status.COMPLETED and s.response.removesuffix("<|im_end|>") in ("yes", "no")
        assert s.response_length == len(s.rollout_log_probs) > 0 and all(lp < 0 for lp in s.rollout_log_probs)
        assert s.reward == float("yes" in s.response)
    # the slow group was aborted in the engine (reached through the router's /workers) and came back partial
    slow = [s for g in ds.buffer for s in g if "SLOW" in s.prompt]
    assert len(slow) == 2 and all(s.status == Status.ABORTED and 0 < s.response_length < SLOW_LEN for s in slow)
    assert all(s.metadata["start_rollout_id"] == 0 and len(s.rollout_log_probs) == s.response_length for s in slow)
    aborts = [r for r in map(json.loads, log.read_text().splitlines()) if r["endpoint"] == "/abort_request"]
    assert len(aborts) == 1 and aborts[0]["aborted"] >= 2  # the slow pair, plus any other group still running
