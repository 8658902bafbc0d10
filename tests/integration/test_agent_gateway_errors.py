"""How the gateway answers when the engine fails, on every API, streaming or not: the status says whose fault
it is (4xx when the engine refused the request, 502 otherwise), the body takes the API's own error shape
(in-band as an SSE `error` event once a stream started), it never names the engine's host:port, and no log
line carries the session's API key. The engine is a small in-process aiohttp app that fails on purpose."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from aiohttp import web

from slime.agent.gateway import Gateway
from slime.utils.async_utils import run
from slime.utils.http_utils import find_free_port

pytestmark = pytest.mark.cpu

BODIES = {
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "m", "input": "hi"},
    "/v1/messages": {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
}


def logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every log line of this process but the test's own HTTP client (httpx logs the URLs it calls)."""
    return [
        rec.getMessage() + (rec.exc_text or "")
        for rec in caplog.records
        if rec.name.split(".")[0] not in ("httpx", "httpcore")
    ]


class FailingEngine:
    """`/generate` answers as `mode` says; every answer names the engine's own address, as real errors can."""

    def __init__(self) -> None:
        self.mode = "rejects"
        self.url = ""
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", lambda r: web.json_response({}))
        self.runner = web.AppRunner(app)

    async def start(self) -> str:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self.url

    async def generate(self, request: web.Request) -> web.Response:
        where = f"{self.url}/generate (worker 10.1.2.3:30001)"
        if self.mode == "rejects":
            return web.json_response({"error": {"message": f"input too long at {where}"}}, status=400)
        if self.mode == "fails":
            return web.Response(text=f"Traceback ... ConnectionError: {where}", status=500)
        if self.mode == "not-json":
            return web.Response(text=f"<html>{where}</html>")
        return web.json_response([where])  # bad shape


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from transformers import AutoTokenizer

    from sim.tiny_checkpoint import build_tiny_checkpoint

    tok = AutoTokenizer.from_pretrained(build_tiny_checkpoint(tmp_path_factory.mktemp("gw_err") / "tiny"))
    engine = FailingEngine()
    run(engine.start())
    live = Gateway(tok, engine.url, admin_token="adm")
    dead = Gateway(tok, f"http://127.0.0.1:{find_free_port()}")  # nothing listens there
    urls = {"live": run(live.start()), "dead": run(dead.start())}
    try:
        yield {"engine": engine, "gw": {"live": live, "dead": dead}, "urls": urls}
    finally:
        run(live.stop())
        run(dead.stop())
        run(engine.runner.cleanup())


def error_of(r: httpx.Response, stream: bool) -> tuple[int, dict[str, Any]]:
    """(status, error body): the HTTP answer, or the in-band `error` event of a stream that had started."""
    if not stream:
        return r.status_code, r.json()
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    lines = r.text.split("\n")
    i = lines.index("event: error")
    body = json.loads(lines[i + 1].removeprefix("data: "))
    return body["error"].get("code") or 0, body


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "which,mode,status,says",
    [
        ("dead", "-", 502, "could not be reached"),
        ("live", "rejects", 400, "rejected the request: input too long"),
        ("live", "fails", 502, "failed (HTTP 500)"),
        ("live", "not-json", 502, "malformed JSON"),
        ("live", "bad-shape", 502, "unexpected shape"),
    ],
)
def test_engine_failures_are_told_in_the_apis_shape_without_internal_addresses(
    stack: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
    which: str,
    mode: str,
    status: int,
    says: str,
    stream: bool,
) -> None:
    gw: Gateway = stack["gw"][which]
    stack["engine"].mode = mode
    engine_hostport = gw.engine.url.split("://", 1)[1]
    caplog.set_level(logging.DEBUG)
    keys = []
    for endpoint, body in BODIES.items():
        sess = run(gw.open_session({}, 0))
        keys.append(sess["api_key"])
        r = httpx.post(f"{sess['base_url']}{endpoint}", json=dict(body, stream=stream), timeout=30)
        assert engine_hostport not in r.text and "10.1.2.3" not in r.text and ":30001" not in r.text, r.text
        got, err = error_of(r, stream)
        if endpoint == "/v1/messages":
            kind = "invalid_request_error" if status < 500 else "api_error"
            assert err["type"] == "error" and err["error"]["type"] == kind, err
            assert says in err["error"]["message"], err
            if not stream:
                assert got == status
        else:
            assert got == status and err["error"]["code"] == status and says in err["error"]["message"], err
    # the gateway logged what happened (with the engine's address: the log is the operator's), never a key
    lines = logged(caplog)
    assert any("/s/***" in line for line in lines)
    for key in keys:
        assert not any(key in line for line in lines)


def test_no_log_line_carries_a_session_key(stack: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """Every way a key reaches the gateway (path prefix, Bearer, x-api-key, with a session id), on requests
    that fail in every layer (body, auth, engine) and on the admin API: no log record contains it."""
    gw: Gateway = stack["gw"]["live"]
    url = stack["urls"]["live"]
    stack["engine"].mode = "fails"
    caplog.set_level(logging.DEBUG)
    sess = run(gw.open_session({}, 0))
    key, sid = sess["api_key"], sess["session_id"]
    ok = BODIES["/v1/messages"]
    requests = [
        (f"/s/{key}/v1/messages", {}, ok),
        (f"/s/{key}/v1/messages", {}, b'{"messages": [' * 5000),
        ("/v1/chat/completions", {"Authorization": f"Bearer {key}"}, BODIES["/v1/chat/completions"]),
        ("/v1/responses", {"x-api-key": key}, b'{"input": "\\udc00"}'),
        (f"/sessions/{sid}/v1/messages", {"x-api-key": key}, ok),
        (f"/sessions/{sid}/v1/messages", {"x-api-key": key + "x"}, ok),
        (f"/s/{key}x/v1/messages", {}, ok),
        (f"/s/{key}/v1/nowhere", {}, ok),
    ]
    statuses = []
    for path, headers, body in requests:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        statuses.append(httpx.post(url + path, content=content, headers=headers, timeout=30).status_code)
    assert statuses == [502, 400, 502, 400, 502, 401, 401, 404]
    r = httpx.post(f"{url}/admin/sessions/{sid}/finish", headers={"Authorization": "Bearer adm"}, timeout=30)
    assert r.status_code == 200 and key not in r.text
    lines = logged(caplog)
    assert lines and not any(key in line for line in lines)
