"""`--agent-harness openai-sdk` end to end through the default rollout: real sglang-router 0.3.2 in front of
the scripted fake engine, the gateway embedded on the rollout loop, the openai client driving a tool loop.
Every returned sample must carry engine-sampled tokens at mask 1 (checked against the fake's request log)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from slime.agent.arguments import resolve_agent_args
from slime.agent.embedded import stop_embedded_gateway
from slime.arguments import default_args
from slime.backends.sglang.router import RouterProcess
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sglang_rollout import generate_rollout
from slime.utils.async_utils import run
from slime.utils.http_utils import find_free_port
from slime.utils.process import ManagedProcess
from slime.utils.types import Sample, Status

pytestmark = pytest.mark.cpu

SCRIPT = {
    "rules": [
        {"match": "<tool_response>\\n5", "completion": "The answer is 5."},
        {"match": "<tool_response>", "completion": "I am not sure."},
        {
            "match": "compute",
            "completion": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>',
        },
    ],
    "default": {"completion": "No idea."},
}


def label_rm(args, sample: Sample) -> float:
    return float(str(sample.label) in sample.response)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[int, Path, Path]]:
    from sim.tiny_checkpoint import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "tiny")
    (tmp_path / "script.json").write_text(json.dumps(SCRIPT))
    log = tmp_path / "engine.jsonl"
    procs: list[ManagedProcess] = []
    router: RouterProcess | None = None
    try:
        eport, rport = find_free_port(), find_free_port()
        cmd = [sys.executable, "-m", "sim.fake_sglang", "--host", "127.0.0.1", "--port", str(eport), "--engine"]
        cmd += ["scripted", "--script", str(tmp_path / "script.json"), "--model-path", str(ckpt)]
        procs.append(ManagedProcess.start(cmd + ["--request-log", str(log)], name="fake engine"))
        procs[-1].wait_healthy(f"http://127.0.0.1:{eport}/health", timeout=120)
        # slime's own router handling: add_worker returns once the router lists the engine healthy (it answers
        # /health before it has registered anything)
        router = RouterProcess.start(
            default_args(), host="127.0.0.1", port=rport, log_file=str(tmp_path / "router.log")
        )
        router.add_worker(f"http://127.0.0.1:{eport}")
        yield rport, ckpt, log
    finally:
        run(stop_embedded_gateway())
        if router is not None:
            router.stop(grace=10)
        for p in reversed(procs):
            p.stop(grace=10)


def test_openai_sdk_harness_through_default_rollout(tmp_path: Path, stack, make_args: Callable[..., Any]) -> None:
    rport, ckpt, log = stack
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"input": f"compute 2+3 (#{i})", "label": "5"}) + "\n" for i in range(3)))
    args = make_args(
        prompt_data=str(data),
        label_key="label",
        hf_checkpoint=str(ckpt),
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        over_sampling_batch_size=2,
        rollout_seed=1,
        sglang_router_ip="127.0.0.1",
        sglang_router_port=rport,
        rollout_max_response_len=64,
        rollout_max_context_len=2048,
        custom_rm_path=f"{__name__}.label_rm",
        agent_harness="openai-sdk",
        agent_max_turns=4,
    )
    resolve_agent_args(args)
    assert args.custom_generate_function_path == "slime.agent.harness.openai_sdk.generate"
    out = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))

    assert len(out.samples) == 2 and all(len(g) == 2 for g in out.samples)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    outputs = {tuple(c["responses"][0]["output_ids"]) for c in calls if c["endpoint"] == "/generate"}
    group_ids = set()
    for group in out.samples:
        for traj in group:
            (s,) = traj  # one segment per trajectory: no drift, no wipe
            assert s.status == Status.COMPLETED and s.reward == 1.0
            assert s.metadata["num_tool_calls"] == 1 and s.metadata["final_answer"] == "The answer is 5."
            resp = s.tokens[len(s.tokens) - s.response_length :]
            trained = [t for t, m in zip(resp, s.loss_mask, strict=True) if m]
            assert trained, "every sample needs engine-generated mask-1 tokens"
            assert len(s.rollout_log_probs) == s.response_length
            assert all(lp < 0 for lp, m in zip(s.rollout_log_probs, s.loss_mask, strict=True) if m)
            # the mask-1 runs are exactly two engine outputs (tool call, then answer)
            runs, cur = [], []
            for t, m in zip(resp, s.loss_mask, strict=True):
                if m:
                    cur.append(t)
                elif cur:
                    runs.append(tuple(cur))
                    cur = []
            if cur:
                runs.append(tuple(cur))
            assert len(runs) == 2 and all(r in outputs for r in runs)
            group_ids.add(s.group_id)
    assert len(group_ids) == 4  # one group id per trajectory
