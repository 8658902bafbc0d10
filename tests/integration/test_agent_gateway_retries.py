"""What a client's retry does to the trajectory: nothing. A request repeated after its answer was lost is answered
from the recorded turn (the engine is not called again, the turn is not recorded twice), a finish repeated
returns the same segments, and a session store that is down answers 503 (retryable) until it is back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sim.fake_sglang.testing import launch_fake_sglang
from slime.agent.gateway import Gateway
from slime.agent.stores import RedisSessionStore
from slime.utils.async_utils import run

pytestmark = pytest.mark.cpu

fakeredis = pytest.importorskip("fakeredis")
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from transformers import AutoTokenizer

    from sim.tiny_checkpoint import build_tiny_checkpoint

    d = tmp_path_factory.mktemp("retries")
    ckpt = build_tiny_checkpoint(d / "tiny")
    script = {"rules": [{"match": "<tool_response>", "completion": "Done."}], "default": {"completion": CALL}}
    (d / "script.json").write_text(json.dumps(script))
    log = d / "engine.jsonl"
    args = ["--engine", "scripted", "--script", str(d / "script.json"), "--model-path", str(ckpt)]
    server = fakeredis.FakeServer()
    store = RedisSessionStore(client=fakeredis.FakeAsyncRedis(server=server, decode_responses=True))
    with launch_fake_sglang(args + ["--request-log", str(log)]) as eng:
        gw = Gateway(AutoTokenizer.from_pretrained(ckpt), eng.url, admin_token="adm", store=store)
        url = run(gw.start())
        try:
            yield {"gw": gw, "url": url, "log": log, "server": server}
        finally:
            run(gw.stop())
            run(store.close())


def generate_calls(stack: dict[str, Any], sid: str) -> list[dict[str, Any]]:
    calls = [json.loads(x) for x in stack["log"].read_text().splitlines()]
    return [c for c in calls if c["endpoint"] == "/generate" and c["body"]["rid"].startswith(sid + "-")]


def chat(stack: dict[str, Any], key: str, messages: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": "m", "messages": messages, "tools": TOOLS}
    return httpx.post(f"{stack['url']}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})


def test_a_repeated_request_is_answered_from_its_recorded_turn(stack: dict[str, Any]) -> None:
    sess = run(stack["gw"].open_session())
    msgs = [{"role": "user", "content": "find x"}]
    first = chat(stack, sess["api_key"], msgs).json()
    again = chat(stack, sess["api_key"], msgs).json()  # its answer was lost: the client sends it again
    assert again["choices"] == first["choices"] and again["id"] == first["id"]
    call = first["choices"][0]["message"]["tool_calls"][0]
    msgs += [first["choices"][0]["message"], {"role": "tool", "tool_call_id": call["id"], "content": "42"}]
    assert chat(stack, sess["api_key"], msgs).json()["choices"][0]["message"]["content"] == "Done."
    assert len(generate_calls(stack, sess["session_id"])) == 2  # the repeat never reached the engine
    (seg,) = run(stack["gw"].finish_session(sess["session_id"]))
    assert seg.metadata["segment_kind"] == "final" and seg.metadata["num_turns"] == 2


def test_a_store_that_is_down_answers_503_until_it_is_back(stack: dict[str, Any]) -> None:
    sess = run(stack["gw"].open_session())
    msgs = [{"role": "user", "content": "find y"}]
    stack["server"].connected = False
    try:
        down = chat(stack, sess["api_key"], msgs)
        assert down.status_code == 503 and down.json()["error"]["type"] == "server_error", down.text
        admin = {"Authorization": "Bearer adm"}
        fin = httpx.post(f"{stack['url']}/admin/sessions/{sess['session_id']}/finish", headers=admin)
        assert fin.status_code == 503, fin.text
    finally:
        stack["server"].connected = True
    assert chat(stack, sess["api_key"], msgs).status_code == 200
