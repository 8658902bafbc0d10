"""No client can stall or sink the gateway: prompts held to the model's context (400 as SGLang answers, the
engine never called), bodies that never arrive (408), too many requests of one session (429), large bodies
prepared in a worker process while other sessions are served, a worker that dies (503, then replaced).

Against the scripted fake engine and the tiny checkpoint (context 4096 tokens). Nothing here asserts on time:
"served while a hostile request is in progress" is checked as an order of events.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from sim.fake_sglang.testing import launch_fake_sglang
from slime.agent.context_limit import ContextLimit
from slime.agent.gateway import Gateway
from slime.agent.prepare_pool import PreparePool
from slime.agent.requests import prepare
from slime.utils.async_utils import run

pytestmark = pytest.mark.cpu

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agent"
BODY_TIMEOUT_S = 1.5
SESSION_LIMIT = 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from transformers import AutoTokenizer

    from sim.tiny_checkpoint import build_tiny_checkpoint

    d = tmp_path_factory.mktemp("admission")
    ckpt = build_tiny_checkpoint(d / "tiny")
    (d / "script.json").write_text(json.dumps({"default": {"completion": "Fine."}}))
    log = d / "engine.jsonl"
    args = ["--engine", "scripted", "--script", str(d / "script.json"), "--model-path", str(ckpt)]
    with launch_fake_sglang(args + ["--request-log", str(log)]) as eng:
        gw = Gateway(
            AutoTokenizer.from_pretrained(ckpt),
            eng.url,
            admin_token="adm",
            body_timeout_s=BODY_TIMEOUT_S,
            max_session_requests=SESSION_LIMIT,
            prepare_workers=1,
        )
        url = run(gw.start())
        try:
            yield {"gw": gw, "url": url, "log": log}
        finally:
            run(gw.stop())


def engine_calls(stack: dict[str, Any], sid: str) -> int:
    lines = stack["log"].read_text().splitlines() if stack["log"].exists() else []
    calls = [json.loads(x) for x in lines]
    return sum(1 for c in calls if c["endpoint"] == "/generate" and c["body"]["rid"].startswith(sid + "-"))


def session(stack: dict[str, Any]) -> dict[str, str]:
    return run(stack["gw"].open_session())  # no max_context_tokens: only the model's context holds


def chat(text: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


def post(stack: dict[str, Any], key: str, path: str, body: Any, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", "anthropic-version": "2023-06-01"}
    return httpx.post(f"{stack['url']}{path}", json=body, headers=headers, timeout=120, **kw)


BODIES = {
    "/v1/chat/completions": lambda t: chat(t),
    "/v1/responses": lambda t: {"model": "m", "input": t},
    "/v1/messages": lambda t: {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": t}]},
}


@pytest.mark.parametrize("path", sorted(BODIES))
def test_a_prompt_over_the_context_is_refused_as_sglang_refuses_it(stack: dict[str, Any], path: str) -> None:
    sess = session(stack)
    counted = post(stack, sess["api_key"], path, BODIES[path]("word " * 6000))  # ~6k tokens: counted exactly
    assert counted.status_code == 400, counted.text
    msg = json.dumps(counted.json())
    assert "is longer than the model's context length (4096 tokens)." in msg and "(at least" not in msg
    assert "The input (" in msg
    bound = post(stack, sess["api_key"], path, BODIES[path]("x" * (1 << 20)))  # 1 MB: refused by its bytes
    assert bound.status_code == 400 and "The input (at least " in json.dumps(bound.json()), bound.text
    assert engine_calls(stack, sess["session_id"]) == 0
    ok = post(stack, sess["api_key"], path, BODIES[path]("hello"))
    assert ok.status_code == 200, ok.text


def test_a_huge_body_is_prepared_by_an_idle_class_worker(stack: dict[str, Any]) -> None:
    """Over 4 MiB (no agent client sends that): its worker gets only CPU nothing else on the host wants."""
    sess = session(stack)
    r = post(stack, sess["api_key"], "/v1/chat/completions", chat("x" * (5 << 20)))
    assert r.status_code == 400 and "The input (at least " in r.text, r.text
    policies = {os.sched_getscheduler(p.pid) for p in prepare_workers()}
    assert os.SCHED_IDLE in policies, policies


def test_count_tokens_counts_and_refuses_only_what_cannot_fit(stack: dict[str, Any]) -> None:
    sess = session(stack)
    path = "/v1/messages/count_tokens"
    body = BODIES["/v1/messages"]
    n = post(stack, sess["api_key"], path, body("word " * 6000))
    assert n.status_code == 200 and n.json()["input_tokens"] > 4096  # counting is not generating: told, not refused
    assert post(stack, sess["api_key"], path, body("x" * (1 << 20))).status_code == 400


def raw_request(stack: dict[str, Any], key: str, declared: int, sent: bytes) -> socket.socket:
    """A request whose body is `declared` bytes long, of which only `sent` is sent (the socket stays open)."""
    host, port = stack["url"].removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=60)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
    )
    s.sendall(head.encode() + sent)
    return s


def wait_for(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 60
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_body_that_never_arrives_gets_408_and_others_are_served_meanwhile(stack: dict[str, Any]) -> None:
    slow, other = session(stack), session(stack)
    s = raw_request(stack, slow["api_key"], 1 << 20, b'{"messages": [')
    try:
        wait_for(lambda: stack["gw"].active.get(slow["session_id"]) == 1, "the slow request was admitted")
        ok = post(stack, other["api_key"], "/v1/chat/completions", chat("hi"))
        assert ok.status_code == 200 and stack["gw"].active.get(slow["session_id"]) == 1  # still being read
        answer = s.recv(4096).decode()
        assert answer.startswith("HTTP/1.1 408"), answer
        assert "request body not received within" in answer
    finally:
        s.close()


def test_one_session_cannot_hold_more_than_its_share(stack: dict[str, Any]) -> None:
    greedy, other = session(stack), session(stack)
    held = [raw_request(stack, greedy["api_key"], 1 << 20, b"{") for _ in range(SESSION_LIMIT)]
    try:
        wait_for(lambda: stack["gw"].active.get(greedy["session_id"]) == SESSION_LIMIT, "both requests admitted")
        over = post(stack, greedy["api_key"], "/v1/messages", BODIES["/v1/messages"]("hi"))
        assert over.status_code == 429 and over.json()["error"]["type"] == "rate_limit_error", over.text
        assert post(stack, other["api_key"], "/v1/chat/completions", chat("hi")).status_code == 200
    finally:
        for s in held:
            s.close()
    wait_for(lambda: greedy["session_id"] not in stack["gw"].active, "the held requests were let go")
    assert post(stack, greedy["api_key"], "/v1/chat/completions", chat("hi")).status_code == 200


def prepare_workers() -> list[psutil.Process]:
    me = psutil.Process()
    return [p for p in me.children(recursive=True) if "slime.agent.prepare_pool" in " ".join(p.cmdline())]


def tools_body(n: int) -> dict[str, Any]:
    params = {"type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(5)}}
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": params}} for i in range(n)]
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}


def in_background(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.update(r=fn()), daemon=True)
    t.start()
    return t, box


def test_a_large_body_is_prepared_off_the_loop_while_others_are_served(stack: dict[str, Any]) -> None:
    """8k tool definitions (the probe's 1.85M-token prompt had 20k): parsed and rendered in a prepare worker,
    refused there by its size; meanwhile /health and another session's turn are answered."""
    hostile, other = session(stack), session(stack)
    t, box = in_background(lambda: post(stack, hostile["api_key"], "/v1/chat/completions", tools_body(8000)))
    wait_for(lambda: prepare_workers() and stack["gw"].active.get(hostile["session_id"]) == 1, "a worker took it")
    assert httpx.get(f"{stack['url']}/health", timeout=60).status_code == 200
    ok = post(stack, other["api_key"], "/v1/chat/completions", chat("hi"))
    assert ok.status_code == 200 and t.is_alive(), "the turn was served before the large body was done"
    t.join(120)
    assert box["r"].status_code == 400 and "The input (at least " in box["r"].text, box["r"].text
    assert engine_calls(stack, hostile["session_id"]) == 0


def test_a_worker_prepares_exactly_what_the_loop_would(stack: dict[str, Any]) -> None:
    """Real Claude Code requests (a sub-agent episode), prepared on the loop and in a worker: the same."""
    gw = stack["gw"]
    limit = ContextLimit(65536, gw.limit.bytes_per_token)  # these prompts need more than the tiny model's 4096
    pool = PreparePool(gw.tokenizer, limit, 1)
    try:
        for line in (FIXTURES / "claude_code_subagent.jsonl").read_text().splitlines():
            raw = json.dumps(json.loads(line)["body"]).encode()
            here = prepare("/messages", raw, gw.builder, limit)
            there = run(pool.prepare("/messages", [raw[:100], raw[100:]], len(raw)))
            assert there == here and here.text and len(here.messages) >= 1
    finally:
        run(pool.close())


def test_a_worker_that_dies_costs_one_retryable_answer(stack: dict[str, Any]) -> None:
    sess = session(stack)
    t, box = in_background(lambda: post(stack, sess["api_key"], "/v1/chat/completions", tools_body(8000)))
    wait_for(lambda: stack["gw"].active.get(sess["session_id"]) == 1 and prepare_workers(), "a worker took it")
    for p in prepare_workers():
        p.kill()
    t.join(120)
    assert box["r"].status_code == 503 and box["r"].json()["error"]["type"] == "server_error", box["r"].text
    many = {"model": "m", "messages": [{"role": "user", "content": "x"}] * 520}  # a shape the loop hands off
    again = post(stack, sess["api_key"], "/v1/chat/completions", many)
    assert again.status_code == 200, again.text  # prepared by a new worker
