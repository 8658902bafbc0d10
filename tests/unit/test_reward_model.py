"""Rewards from a reward model of `--sglang-config`: batched `/generate` scoring and `/v1/chat/completions` judging
against a fake scripted judge; retries of transient failures; an answer without a score is an error, never 0; flags
naming models are checked against the topology."""

from __future__ import annotations

import asyncio

import pytest
import yaml
from aiohttp import web

from sim.fake_sglang.testing import launch_fake_sglang
from sim.tiny_checkpoint import build_tiny_checkpoint
from slime.arguments import default_args
from slime.backends.sglang.sglang_config import check_model_references
from slime.rollout.rm_hub import batched_async_rm, close_remote_session
from slime.rollout.rm_hub.reward_model import RewardModelError
from slime.utils.errors import SlimeArgError
from slime.utils.http_utils import find_free_port
from slime.utils.types import Sample, Status

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    d = tmp_path_factory.mktemp("judge")
    ckpt = build_tiny_checkpoint(d / "ckpt")
    (d / "s.yaml").write_text(yaml.safe_dump({"rules": [
        {"match": "Response: [^\\n]*[0-9]", "completion": "score: 1.0"},
        {"match": "Response: silent", "completion": "I refuse to score."},
        {"match": "Score the response", "completion": "score: 0.25"},
    ]}))  # fmt: skip
    log = d / "log.jsonl"
    with launch_fake_sglang(["--engine", "scripted", "--model-path", str(ckpt), "--script", str(d / "s.yaml"),
                             "--request-log", str(log)]) as s:  # fmt: skip
        s.log = log
        yield s


def _samples(*responses):
    return [Sample(index=i, prompt="reverse 12", response=r, label="21", status=Status.COMPLETED)
            for i, r in enumerate(responses)]  # fmt: skip


def _run(args, samples):
    async def go():
        try:
            return await batched_async_rm(args, samples)
        finally:
            await close_remote_session()

    return asyncio.run(go())


@pytest.mark.parametrize("rm_type", ["reward_model", "reward_model_chat"])
def test_reward_model_scores_through_its_router(judge, rm_type):
    args = default_args(rm_type=rm_type, rm_model_name="judge")
    args.sglang_model_routers = {"judge": judge.url}
    before = len(judge.log.read_text().splitlines()) if judge.log.exists() else 0
    assert _run(args, _samples("it is 21", "no idea", "2 1")) == [1.0, 0.25, 1.0]
    import json

    new = [json.loads(x) for x in judge.log.read_text().splitlines()[before:]]
    if rm_type == "reward_model":  # the whole list in one batched /generate
        assert [x["endpoint"] for x in new] == ["/generate"] and len(new[0]["body"]["text"]) == 3
    else:
        assert [x["endpoint"] for x in new] == ["/v1/chat/completions"] * 3


@pytest.mark.parametrize("rm_type", ["reward_model", "reward_model_chat"])
def test_an_answer_without_a_score_is_an_error(judge, rm_type):
    args = default_args(rm_type=rm_type, rm_model_name="judge")
    args.sglang_model_routers = {"judge": judge.url}
    with pytest.raises(RewardModelError, match="gave sample 1 no `score"):
        _run(args, _samples("it is 21", "silent"))


def test_transient_failures_are_retried_then_fail_clearly():
    calls = {"n": 0}

    async def flaky(request):
        calls["n"] += 1
        if calls["n"] < 3:
            return web.Response(status=503, text="warming up")
        return web.json_response({"choices": [{"message": {"content": "score: 0.5"}}]})

    async def broken(request):
        return web.Response(status=400, text="bad judge request")

    async def go():
        app = web.Application()
        app.router.add_post("/ok/v1/chat/completions", flaky)
        app.router.add_post("/bad/v1/chat/completions", broken)
        runner = web.AppRunner(app)
        await runner.setup()
        port = find_free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        args = default_args(rm_type="reward_model_chat", rm_model_name="ok")
        args.sglang_model_routers = {"ok": f"http://127.0.0.1:{port}/ok", "bad": f"http://127.0.0.1:{port}/bad"}
        try:
            from slime.rollout.rm_hub import reward_model

            got = await reward_model.reward_model_chat_reward(args, _samples("x")[0])
            args.rm_model_name = "bad"
            with pytest.raises(RuntimeError, match="HTTP 400: bad judge request"):
                await reward_model.reward_model_chat_reward(args, _samples("x")[0])
            return got
        finally:
            await close_remote_session()
            await runner.cleanup()

    assert asyncio.run(go()) == 0.5 and calls["n"] == 3


def test_flags_naming_models_are_checked_against_the_topology(tmp_path):
    ckpt = str(build_tiny_checkpoint(tmp_path / "m"))
    topo = tmp_path / "topo.yaml"
    topo.write_text(yaml.safe_dump({"sglang": [
        {"name": "actor", "server_groups": [{"num_gpus": 1}]},
        {"name": "ref", "update_weights": False, "server_groups": [{"num_gpus": 1}]},
    ]}))  # fmt: skip
    base = {"hf_checkpoint": ckpt, "sglang_config": str(topo), "rollout_num_gpus": 2}
    check_model_references(default_args(**base, ref_model_name="ref", use_kl_loss=True))  # fine
    with pytest.raises(SlimeArgError, match="--rm-model-name reward: no such model"):
        check_model_references(default_args(**base, rm_type="reward_model"))
    with pytest.raises(SlimeArgError, match="--opd-teacher-models teacher: no such model"):
        check_model_references(default_args(**base, use_opd=True, opd_type="sglang"))
    with pytest.raises(SlimeArgError, match="receives the actor's weights"):
        check_model_references(default_args(**base, ref_model_name="actor", use_kl_loss=True))
