"""Chains over HTTP, with two gateways sharing one Redis-backed store (fakeredis): a Claude-Code-shaped
episode whose main agent calls `Agent`, whose sub-agent runs a tool, plus a small/fast-model call, all
alternating between the two gateways; then finish on the other one. Also: a turn in flight on one process
when finish is called on the other is aborted at the engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sim.fake_sglang.testing import launch_fake_sglang
from slime.agent.gateway import Gateway
from slime.agent.harness.cli import trainable
from slime.agent.stores import RedisSessionStore
from slime.agent.trajectory import segment_to_json
from slime.utils.async_utils import run

# GPU hosts run `pytest -m gpu tests` without the agent extras: skip this module there, do not fail collection
fakeredis = pytest.importorskip("fakeredis")

pytestmark = pytest.mark.cpu


def call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


SUB_PROMPT = "SUBJOB-42: create sub.txt"
SCRIPT = {
    "rules": [
        {"match": "SLOW", "completion": "la " * 3000},
        {"match": r"(TASK-DELEGATE|SUBJOB-42)[\s\S]*<tool_response>", "completion": "Done."},
        {"match": "SUBJOB-42", "completion": call("Bash", {"command": "echo sub > sub.txt"})},
        {"match": "TASK-DELEGATE", "completion": call("Agent", {"description": "d", "prompt": SUB_PROMPT})},
    ],
    "default": {"completion": "short."},
    "token_latency_s": 0.002,
}
TOOLS = [
    {"name": n, "description": n, "input_schema": {"type": "object", "properties": {p: {"type": "string"}}}}
    for n, p in (("Agent", "prompt"), ("Bash", "command"))
]


def billing(sub: bool) -> dict[str, str]:
    tail = " cc_is_subagent=true;" if sub else ""
    return {
        "type": "text",
        "text": f"x-anthropic-billing-header: cc_version=2.1.197.abc; cc_entrypoint=sdk-cli;{tail}",
    }


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Gateway], list[str], Path]]:
    from transformers import AutoTokenizer

    from sim.tiny_checkpoint import build_tiny_checkpoint

    d = tmp_path_factory.mktemp("chains")
    ckpt = build_tiny_checkpoint(d / "tiny")
    (d / "script.json").write_text(json.dumps(SCRIPT))
    log = d / "engine.jsonl"
    args = ["--engine", "scripted", "--script", str(d / "script.json"), "--model-path", str(ckpt)]
    with launch_fake_sglang(args + ["--request-log", str(log)]) as eng:
        server = fakeredis.FakeServer()
        tok = AutoTokenizer.from_pretrained(ckpt)
        gws = [
            Gateway(
                tok,
                eng.url,
                store=RedisSessionStore(client=fakeredis.FakeAsyncRedis(server=server, decode_responses=True)),
                aux_models=["slime-small-fast"],
            )
            for _ in range(2)
        ]
        urls = [run(g.start()) for g in gws]
        try:
            yield gws, urls, log
        finally:
            for g in gws:
                run(g.stop())
                run(g.store.close())


def post(
    url: str, key: str, system: list[dict[str, str]], messages: list[dict[str, Any]], model: str = "slime-policy"
):
    body = {"model": model, "max_tokens": 512, "stream": True, "system": system, "messages": messages, "tools": TOOLS}
    r = httpx.post(f"{url}/v1/messages?beta=true", json=body, headers={"x-api-key": key}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    blocks: dict[int, dict[str, Any]] = {}
    for ev in r.text.split("\n\n"):
        data = ev.partition("data: ")[2]
        if not data:
            continue
        d = json.loads(data)
        if d["type"] == "content_block_start":
            blocks[d["index"]] = dict(d["content_block"])
        elif d["type"] == "content_block_delta" and d["delta"]["type"] == "text_delta":
            blocks[d["index"]]["text"] += d["delta"]["text"]
        elif d["type"] == "content_block_delta" and d["delta"]["type"] == "input_json_delta":
            blocks[d["index"]]["input"] = json.loads(d["delta"]["partial_json"])
    return [blocks[i] for i in sorted(blocks)]


def test_subagent_and_auxiliary_chains_across_two_gateways(gateways) -> None:
    (a, b), (ua, ub), _ = gateways
    sess = run(a.open_session({"temperature": 1.0}, 32768))
    key = sess["api_key"]
    main_sys = [billing(False), {"type": "text", "text": "You are the main agent."}]
    sub_sys = [billing(True), {"type": "text", "text": "You are a sub-agent."}]
    reminder = {"type": "text", "text": "<system-reminder>today</system-reminder>"}

    main_msgs: list[dict[str, Any]] = [
        {"role": "user", "content": [reminder, {"type": "text", "text": "TASK-DELEGATE"}]}
    ]
    (agent_use,) = post(ua, key, main_sys, main_msgs)
    assert agent_use["name"] == "Agent" and agent_use["input"]["prompt"] == SUB_PROMPT

    sub_msgs: list[dict[str, Any]] = [{"role": "user", "content": [reminder, {"type": "text", "text": SUB_PROMPT}]}]
    (bash_use,) = post(ub, key, sub_sys, sub_msgs)  # the other process: same session through Redis
    assert bash_use["name"] == "Bash"
    sub_msgs += [
        {"role": "assistant", "content": [bash_use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": bash_use["id"], "content": "ok"}]},
    ]
    assert post(ua, key, sub_sys, sub_msgs)[0]["text"] == "Done."

    small = [{"role": "user", "content": "title please"}]
    assert post(ub, key, [], small, model="slime-small-fast")[0]["text"] == "short."

    main_msgs += [
        {"role": "assistant", "content": [agent_use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": agent_use["id"], "content": "Done."}]},
    ]
    assert post(ua, key, main_sys, main_msgs)[0]["text"] == "Done."

    segs = run(b.finish_session(sess["session_id"]))  # finish on the other process
    kinds = [g.metadata["segment_kind"] for g in segs]
    assert kinds == ["subagent", "auxiliary", "final"], kinds
    assert [g.metadata["num_turns"] for g in segs] == [2, 1, 2]
    assert all(g.metadata["num_drifts"] == 0 for g in segs)
    assert sum(segs[1].loss_mask) == 0 and sum(segs[0].loss_mask) > 0 and sum(segs[2].loss_mask) > 0
    kept, n_aux = trainable(segs)
    assert n_aux == 1 and [g.metadata["segment_kind"] for g in kept] == ["subagent", "final"]
    again = run(a.finish_session(sess["session_id"]))  # a retried finish, on either process: the same segments
    assert [segment_to_json(g) for g in again] == [segment_to_json(g) for g in segs]


def test_finish_aborts_a_turn_in_flight_on_the_other_process(gateways, monkeypatch: pytest.MonkeyPatch) -> None:
    (a, b), (ua, _), log = gateways
    monkeypatch.setattr("slime.agent.gateway.FINISH_WAIT_S", 0.3)
    sess = run(a.open_session({"temperature": 1.0}, 32768))

    async def scenario() -> tuple[list[Any], httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as c:
            body = {
                "model": "m",
                "max_tokens": 4000,
                "stream": True,
                "messages": [{"role": "user", "content": "SLOW"}],
            }
            req = asyncio.create_task(c.post(f"{ua}/v1/messages", json=body, headers={"x-api-key": sess["api_key"]}))
            for _ in range(200):
                snap = await b.store.get(sess["session_id"])
                if snap.inflight:
                    break
                await asyncio.sleep(0.02)
            assert snap.inflight, "the turn never started"
            segs = await b.finish_session(sess["session_id"])
            return segs, await req

    segs, resp = run(scenario())
    assert segs == []  # nothing finished was sampled
    assert '"error"' in resp.text  # the stream ended with an in-band error
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(
        r["endpoint"] == "/abort_request" and str(r["body"].get("rid", "")).startswith(sess["session_id"])
        for r in recs
    )
