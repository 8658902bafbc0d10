"""`SGLangClient.send`: calls pipelined on one connection come back in order, each exactly once, and a kept-alive
connection the server closed meanwhile is retried once; the weight-sync session opens and closes through it."""

from __future__ import annotations

import http.client
import http.server
import json
import threading
import time
from collections.abc import Iterator

import pytest

from slime.backends.sglang.client import ERRORS, SGLangClient, SGLangError, end_weight_sync, start_weight_sync

pytestmark = pytest.mark.cpu


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and requests read one after the other from the same buffer

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        server = self.server
        server.seen.append((self.path, json.loads(body) if body else None, self.client_address[1]))  # type: ignore[attr-defined]
        status, reply = 200, json.dumps({"path": self.path, "n": len(server.seen)}).encode()  # type: ignore[attr-defined]
        if self.path == "/refuse":
            status, reply = 400, b"no"
        if self.path == "/fail":
            reply = json.dumps({"success": False, "message": "session already open"}).encode()
        self.send_response(status)
        if self.path == "/bye":
            self.send_header("Connection", "close")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)
        if self.path == "/drop-after":  # answered as kept alive, then closed: the client finds out on next use
            self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[http.server.ThreadingHTTPServer]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.seen = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(10)


def _url(srv: http.server.ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def test_pipelined_calls_answer_in_order_on_one_connection(server) -> None:
    with SGLangClient(_url(server)) as c:
        read = c.send([("POST", f"/call/{i}", {"i": i}) for i in range(5)] + [("POST", "/refuse", None)])
        answers = read()
        assert [s for s, _ in answers] == [200] * 5 + [400]
        assert [json.loads(b)["path"] for _, b in answers[:5]] == [f"/call/{i}" for i in range(5)]
        assert [(p, b) for p, b, _ in server.seen] == [(f"/call/{i}", {"i": i}) for i in range(5)] + [("/refuse", {})]
        assert len({conn for _, _, conn in server.seen}) == 1  # one connection for all six
        # the connection stays usable for plain calls, and for another pipeline
        assert c.request("POST", "/after", {})[0] == 200
        assert [s for s, _ in c.send([("POST", "/x", {}), ("POST", "/y", {})])()] == [200, 200]
        assert len({conn for _, _, conn in server.seen}) == 1


def test_sends_in_flight_together_are_read_one_after_the_other(server) -> None:
    """Posts overlap in a sync: the second is written before the first's answer is read; each reader gets its
    own answers though the first's reader may have buffered the second's (a lost answer times out)."""
    with SGLangClient(_url(server), timeout=10.0) as c:
        first = c.send([("POST", "/one", {"pad": "x" * 100})])
        second = c.send([("POST", "/two", {}), ("POST", "/three", {})])
        third = c.send([("POST", "/four", {})])
        deadline = time.monotonic() + 30
        while len(server.seen) < 4 and time.monotonic() < deadline:  # every answer waits in the socket at once
            time.sleep(0.01)
        time.sleep(0.05)
        assert [json.loads(b)["path"] for _, b in first()] == ["/one"]
        assert [json.loads(b)["path"] for _, b in second()] == ["/two", "/three"]
        assert [json.loads(b)["path"] for _, b in third()] == ["/four"]
        assert len({conn for _, _, conn in server.seen}) == 1


def test_a_stale_kept_alive_connection_is_retried_once(server) -> None:
    with SGLangClient(_url(server)) as c:
        assert c.request("POST", "/drop-after", {})[0] == 200  # the server closes this connection afterwards
        answers = c.send([("POST", "/a", {}), ("POST", "/b", {})])()
        assert [json.loads(b)["path"] for _, b in answers] == ["/a", "/b"]
        assert [p for p, _, _ in server.seen] == ["/drop-after", "/a", "/b"]  # each exactly once


def test_sends_in_flight_on_a_stale_connection_are_never_reordered(server) -> None:
    """Two sends written to a connection the server closed: where the failure shows on reading the first, both
    are sent again in order; where it shows on writing the second, both fail (sent elsewhere, the second would
    overtake the first, and the first may have been answered already). Never the second before the first."""
    for _ in range(8):
        server.seen.clear()
        with SGLangClient(_url(server), timeout=10.0) as c:
            assert c.request("POST", "/drop-after", {})[0] == 200
            time.sleep(0.02)  # the server has closed it
            first = c.send([("POST", "/a", {})])
            try:
                second = c.send([("POST", "/b", {})])
            except ERRORS:
                with pytest.raises(ERRORS):
                    first()
                assert [p for p, _, _ in server.seen] == ["/drop-after"]
                continue
            assert [json.loads(b)["path"] for _, b in first()] == ["/a"]
            assert [json.loads(b)["path"] for _, b in second()] == ["/b"]
            assert [p for p, _, _ in server.seen] == ["/drop-after", "/a", "/b"]


def test_a_connection_idle_past_the_servers_keep_alive_is_replaced_before_use(server, monkeypatch) -> None:
    """uvicorn closes kept-alive connections idle for 5 s: a call after a longer pause goes out on a fresh
    connection at once, not on the old one first (whose failure would show only when its answer is awaited)."""
    import slime.backends.sglang.client as client

    monkeypatch.setattr(client, "IDLE_RECONNECT_S", 0.2)
    with SGLangClient(_url(server)) as c:
        assert [s for s, _ in c.send([("POST", "/a", {})])()] == [200]
        assert c.request("POST", "/b", {})[0] == 200  # used at once: the same connection
        time.sleep(0.3)
        assert [s for s, _ in c.send([("POST", "/c", {})])()] == [200]
        conns = [conn for _, _, conn in server.seen]
        assert conns[0] == conns[1] != conns[2], server.seen


def test_a_server_closing_midway_is_an_error_not_a_missing_answer(server) -> None:
    with SGLangClient(_url(server)) as c:
        read = c.send([("POST", "/bye", {}), ("POST", "/never", {})])
        with pytest.raises(http.client.RemoteDisconnected, match="after 1 of 2 calls"):
            read()
        assert [p for p, _, _ in server.seen] == ["/bye"]
        assert c.request("POST", "/again", {})[0] == 200  # a fresh connection afterwards


@pytest.mark.parametrize("version", ["0.5.17", "0.5.23"])
def test_weight_sync_session_against_the_fake_server(tmp_path, version) -> None:
    """The session's calls pipelined to a fake SGLang server, served in order: paused and open after the start,
    resumed after the end; a second open session and an end without one refused as SGLang 0.5.21+ refuses them.
    A release without update sessions (0.5.17) gets pause, flush and continue only: its server has no
    `/begin_weight_update` (it would answer 404 and the sync would fail at its first call)."""
    from sim.fake_sglang.testing import launch_fake_sglang

    (tmp_path / "c.json").write_text(json.dumps({"vocab_size": 100}))
    log = tmp_path / "log.jsonl"
    args = ["--engine", "synthetic", "--synthetic-config", str(tmp_path / "c.json"), "--request-log", str(log)]
    sessions = version == "0.5.23"
    with launch_fake_sglang([*args, "--sglang-version", version]) as srv, SGLangClient(srv.url) as c:
        start_weight_sync([c])()
        assert c.server_info()["internal_states"][0]["paused"] is True
        assert c.protocol.version == version and c.protocol.weight_update_sessions is sessions
        if sessions:
            with pytest.raises(SGLangError, match="already open"):
                start_weight_sync([c])()
        end_weight_sync([c])
        assert c.server_info()["internal_states"][0]["paused"] is False
        if sessions:
            with pytest.raises(SGLangError, match="no weight-update session is open"):
                end_weight_sync([c])
        assert c.request("POST", "/begin_weight_update", {})[0] == (200 if sessions else 404)
    calls = [json.loads(line)["endpoint"] for line in log.read_text().splitlines()]
    calls = [e for e in calls if e != "/server_info"][:-1]  # the last: the bare begin above
    if sessions:
        opening, closing = ["/pause_generation", "/flush_cache", "/begin_weight_update"], ["/end_weight_update"]
        assert calls == opening + opening + closing + ["/continue_generation"] + closing + ["/continue_generation"]
    else:
        assert calls == ["/pause_generation", "/flush_cache", "/continue_generation"]
