"""Contract tests: the real openai / openai-agents / anthropic SDKs against the gateway, backed by the
`scripted` fake engine on loopback. For every episode the merged sample must hold exactly the token ids the
engine sampled (read back from the fake's request log), with aligned non-zero log-probs, and everything
else (tool results, template glue) at mask 0."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sim.fake_sglang.scripted_engine import scripted_logprob
from sim.fake_sglang.testing import launch_fake_sglang
from slime.agent.gateway import Gateway
from slime.agent.trajectory import segment_to_json
from slime.utils.async_utils import run
from slime.utils.http_utils import find_free_port

pytestmark = pytest.mark.cpu

TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCRIPT = {
    "rules": [
        {"match": "SLOW", "completion": "la " * 2000, "finish_reason": "length"},
        {"match": "<tool_response>", "completion": "It is sunny in Paris."},
        {"match": "THINK", "completion": "<think>\nThe user wants the weather.\n</think>\n\n" + TOOL_CALL},
        {"match": "get_weather", "completion": TOOL_CALL},
    ],
    "default": {"completion": "Hello there."},
    "token_latency_s": 0.002,
}
ADMIN = "admin-secret"
WEATHER_CHAT_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class Stack:
    def __init__(self, gw: Gateway, url: str, log: Path) -> None:
        self.gw, self.url, self.log = gw, url, log

    def session(self) -> dict[str, str]:
        return run(self.gw.open_session({"temperature": 1.0}, 4096))

    def finish(self, sid: str) -> list[dict[str, Any]]:
        return [segment_to_json(s) for s in run(self.gw.finish_session(sid))]

    def engine_calls(self, sid: str) -> list[dict[str, Any]]:
        recs = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [r for r in recs if r["endpoint"] == "/generate" and str(r["body"]["rid"]).startswith(sid + "-")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from transformers import AutoTokenizer

    from sim.tiny_checkpoint import build_tiny_checkpoint

    d = tmp_path_factory.mktemp("agent_sdk")
    ckpt = build_tiny_checkpoint(d / "tiny")
    (d / "script.json").write_text(json.dumps(SCRIPT))
    log = d / "engine.jsonl"
    args = ["--engine", "scripted", "--script", str(d / "script.json"), "--model-path", str(ckpt)]
    with launch_fake_sglang(args + ["--request-log", str(log)]) as eng:
        gw = Gateway(AutoTokenizer.from_pretrained(ckpt), eng.url, admin_token=ADMIN)
        url = run(gw.start())
        try:
            yield Stack(gw, url, log)
        finally:
            run(gw.stop())


def check_exact_tokens(stack: Stack, sid: str, samples: list[dict[str, Any]], n_calls: int) -> None:
    """One merged sample = the last prompt + its output; mask 1 exactly on every sampled token."""
    calls = stack.engine_calls(sid)
    assert len(calls) == n_calls and len(samples) == 1
    s = samples[0]
    tokens, p = s["tokens"], s["prompt_length"]
    mask = [0] * p + s["loss_mask"]
    lps = [0.0] * p + s["rollout_log_probs"]
    expected: set[int] = set()
    for c in calls:
        inp, out = c["body"]["input_ids"], c["responses"][0]["output_ids"]
        assert tokens[: len(inp)] == inp, "a later context must extend this prompt token for token"
        assert tokens[len(inp) : len(inp) + len(out)] == out
        for j, t in enumerate(out):
            expected.add(len(inp) + j)
            assert lps[len(inp) + j] == pytest.approx(scripted_logprob(t, j)) != 0.0
    last = calls[-1]
    assert tokens == last["body"]["input_ids"] + last["responses"][0]["output_ids"]
    assert {i for i, m in enumerate(mask) if m} == expected
    assert all(lp == 0.0 for lp, m in zip(lps, mask, strict=True) if not m)


def tool_response_masked(stack: Stack, sample: dict[str, Any]) -> bool:
    """The tool result text sits in the mask-0 part of the response."""
    tok = stack.gw.tokenizer
    p = sample["prompt_length"]
    ctx = [t for t, m in zip(sample["tokens"][p:], sample["loss_mask"], strict=True) if m == 0]
    trained = [t for t, m in zip(sample["tokens"][p:], sample["loss_mask"], strict=True) if m == 1]
    return "<tool_response>" in tok.decode(ctx) and "<tool_response>" not in tok.decode(trained)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_tools_round_trip(stack: Stack, stream: bool) -> None:
    from openai import OpenAI

    sess = stack.session()
    client = OpenAI(base_url=f"{stack.url}/v1", api_key=sess["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "weather in Paris?"},
    ]
    if stream:
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in client.chat.completions.create(
            model="m",
            messages=messages,
            tools=[WEATHER_CHAT_TOOL],
            stream=True,
            stream_options={"include_usage": True},
        ):
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
                for tc in ch.delta.tool_calls or []:
                    c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    c["id"] = tc.id or c["id"]
                    c["name"] = (tc.function.name or "") or c["name"]
                    c["arguments"] += tc.function.arguments or ""
        assert finish == "tool_calls" and calls[0]["name"] == "get_weather"
        assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
        tool_calls = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls.values()
        ]
        messages.append({"role": "assistant", "tool_calls": tool_calls})
        call_id = calls[0]["id"]
    else:
        r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER_CHAT_TOOL])
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls[0].function.name == "get_weather"
        assert r.usage.completion_tokens > 0
        messages.append(msg.model_dump(exclude_none=True))  # no "content" key, as the SDK docs do it
        call_id = msg.tool_calls[0].id
    messages.append({"role": "tool", "tool_call_id": call_id, "content": '{"temp_c": 21}'})
    if stream:
        with client.chat.completions.stream(model="m", messages=messages, tools=[WEATHER_CHAT_TOOL]) as s:
            final = s.get_final_completion()
    else:
        final = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER_CHAT_TOOL])
    assert final.choices[0].message.content == "It is sunny in Paris."
    samples = stack.finish(sess["session_id"])
    check_exact_tokens(stack, sess["session_id"], samples, 2)
    assert tool_response_masked(stack, samples[0])


def test_openai_responses_function_call_round_trip(stack: Stack) -> None:
    from openai import OpenAI

    sess = stack.session()
    client = OpenAI(base_url=f"{stack.url}/v1", api_key=sess["api_key"], max_retries=0)
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Get weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            "strict": True,
        }
    ]
    completed = None
    events = []
    for ev in client.responses.create(model="m", input="weather in Paris?", tools=tools, stream=True):
        events.append(ev.type)
        if ev.type == "response.completed":
            completed = ev.response
    assert events[0] == "response.created" and "response.output_item.added" in events
    calls = [o for o in completed.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    inp = [
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21C"},
    ]
    r2 = client.responses.create(model="m", input=inp, tools=tools)
    assert r2.output_text == "It is sunny in Paris." and r2.status == "completed"
    samples = stack.finish(sess["session_id"])
    check_exact_tokens(stack, sess["session_id"], samples, 2)
    assert tool_response_masked(stack, samples[0])


@pytest.mark.parametrize("model_kind", ["chat", "responses"])
def test_openai_agents_function_tool(stack: Stack, model_kind: str) -> None:
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        seen.append(city)
        return f"The weather in {city} is sunny, 21C."

    sess = stack.session()

    async def episode() -> str:
        client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=sess["api_key"], max_retries=0)
        cls = OpenAIChatCompletionsModel if model_kind == "chat" else OpenAIResponsesModel
        agent = Agent(
            name="Assistant",
            instructions="You are a helpful weather assistant.",
            tools=[get_weather],
            model=cls(model="m", openai_client=client),
        )
        if model_kind == "chat":
            result = await Runner.run(agent, "What's the weather in Paris?")
        else:
            result = Runner.run_streamed(agent, "What's the weather in Paris?")
            async for _ in result.stream_events():
                pass
        await client.close()
        return str(result.final_output)

    final = asyncio.run(episode())
    assert seen == ["Paris"] and final == "It is sunny in Paris."
    samples = stack.finish(sess["session_id"])
    check_exact_tokens(stack, sess["session_id"], samples, 2)
    assert tool_response_masked(stack, samples[0])


def test_anthropic_stream_tools_thinking_signature(stack: Stack) -> None:
    import anthropic

    sess = stack.session()
    client = anthropic.Anthropic(base_url=stack.url, api_key=sess["api_key"], max_retries=0)
    tools = [
        {
            "name": "get_weather",
            "description": "Get weather for a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }
    ]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "THINK: weather in Paris?"}]
    n = client.messages.count_tokens(model="m", messages=messages, tools=tools)
    assert n.input_tokens > 0
    with client.messages.stream(
        model="m", max_tokens=256, messages=messages, tools=tools, thinking={"type": "enabled", "budget_tokens": 64}
    ) as s:
        first = s.get_final_message()
    kinds = [b.type for b in first.content]
    assert kinds == ["thinking", "tool_use"] and first.stop_reason == "tool_use"
    assert first.content[0].signature and first.content[0].thinking == "The user wants the weather."
    assert first.content[1].input == {"city": "Paris"}
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
    messages.append(
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[1].id, "content": "21C"}]}
    )
    with client.messages.stream(model="m", max_tokens=256, messages=messages, tools=tools) as s:
        second = s.get_final_message()
    assert second.content[0].text == "It is sunny in Paris." and second.stop_reason == "end_turn"
    samples = stack.finish(sess["session_id"])
    check_exact_tokens(stack, sess["session_id"], samples, 2)
    assert tool_response_masked(stack, samples[0])


def test_sse_disconnect_aborts_engine_request(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    started: set[str] = set()
    generate = stack.gw.engine.generate

    async def recording_generate(*a: Any, rid: str, **kw: Any) -> Any:
        started.add(rid)
        return await generate(*a, rid=rid, **kw)

    monkeypatch.setattr(stack.gw.engine, "generate", recording_generate)
    sess = stack.session()
    body = {"model": "m", "max_tokens": 4000, "stream": True, "messages": [{"role": "user", "content": "SLOW"}]}
    headers = {"x-api-key": sess["api_key"], "anthropic-version": "2023-06-01"}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", f"{stack.url}/v1/messages", json=body, headers=headers) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data:") and "message_start" in line:
                    rid = json.loads(line[5:])["message"]["id"].removeprefix("msg_")
                    break
            # message_start goes out before the prompt is built: drop the stream only once the engine has the
            # request (a drop before it leaves nothing to abort, and the test would prove nothing)
            for _ in range(300):
                if rid in started:
                    break
                run(asyncio.sleep(0.01))
            assert rid in started, f"the engine never got {rid}"
    # dropped mid-response: the gateway must abort that engine request by rid
    aborts: list[dict[str, Any]] = []
    for _ in range(300):  # tenths of a second
        recs = [json.loads(line) for line in stack.log.read_text().splitlines()]
        aborts = [r for r in recs if r["endpoint"] == "/abort_request" and r["body"].get("rid") == rid]
        if aborts:
            break
        run(asyncio.sleep(0.1))
    assert aborts, f"no /abort_request for {rid}"
    assert stack.finish(sess["session_id"]) == []  # nothing finished was sampled


def test_admin_api_and_session_lifecycle(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        assert c.post("/admin/sessions", json={}).status_code == 401
        assert c.post("/admin/sessions", json={}, headers={"Authorization": "Bearer nope"}).status_code == 401
        admin = {"Authorization": f"Bearer {ADMIN}"}
        bad = c.post("/admin/sessions", json={"max_context_tokens": "x"}, headers=admin)
        assert bad.status_code == 400 and "max_context_tokens" in bad.json()["error"]["message"]
        sess = c.post("/admin/sessions", json={"max_context_tokens": 2048}, headers=admin).json()
        assert set(sess) == {"session_id", "api_key", "base_url"}
        # the base_url alone authenticates (per-session path prefix), whatever key the client sends
        r = c.post(
            f"{sess['base_url']}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": "Bearer dummy"},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello there."
        info = c.get(f"/admin/sessions/{sess['session_id']}", headers=admin).json()
        assert info["num_requests"] == 1 and info["finished"] is False
        assert c.get("/admin/sessions/sess-unknown", headers=admin).status_code == 404
        done = c.post(f"/admin/sessions/{sess['session_id']}/finish", headers=admin).json()
        check_exact_tokens(stack, sess["session_id"], done["samples"], 1)
        again = c.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-api-key": sess["api_key"]},
        )
        assert again.status_code == 409
        retried = c.post(f"/admin/sessions/{sess['session_id']}/finish", headers=admin)  # its answer was lost
        assert retried.status_code == 200 and retried.json() == done
        assert c.head("/").status_code == 200 and c.get("/v1/models").json()["data"][0]["id"] == "slime-policy"


def test_slime_gateway_cli(stack: Stack) -> None:
    """`slime gateway` as its own process: admin API opens a session, a request is served, SIGTERM stops it."""
    import subprocess
    import sys

    from sim.fake_sglang.testing import stop_process

    port = find_free_port()
    engine_url = stack.gw.engine.url
    ckpt = stack.gw.tokenizer.name_or_path
    cmd = [sys.executable, "-m", "slime.cli", "gateway", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--engine-url", engine_url, "--hf-checkpoint", str(ckpt), "--admin-token", "t"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert "slime gateway ready" in line
        url = f"http://127.0.0.1:{port}"
        sess = httpx.post(f"{url}/admin/sessions", json={}, headers={"Authorization": "Bearer t"}).json()
        r = httpx.post(
            f"{url}/v1/messages",
            json={"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {sess['api_key']}"},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["content"][0]["text"] == "Hello there."
        done = httpx.post(f"{url}/admin/sessions/{sess['session_id']}/finish", headers={"Authorization": "Bearer t"})
        assert len(done.json()["samples"]) == 1
    finally:
        assert stop_process(proc) == 0
        proc.stdout.close()
