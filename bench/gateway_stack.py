"""The real pieces the gateway benches run: a `redis-server` with persistence, the scripted fake engine, `slime
gateway` processes that can be killed and started again on their port, an HTTP client that retries as agent
clients do, and the check that a finished session's trajectory is exactly the engine's tokens.

Used by `bench/gateway_soak.py`, `bench/gateway_hostile.py` and their CI-sized tests; everything binds loopback.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from slime.utils.http_utils import find_free_port
from slime.utils.process import ManagedProcess, die_with_parent, stop_popen

ADMIN = "admin-t"
RETRYABLE = {408, 429, 502, 503, 504}  # what the Anthropic and OpenAI SDKs retry (and 5xx, which 500 must not be)
# the scripted policy: a fixed answer per turn, the session's last turn closes with another
SCRIPT = {
    "rules": [{"match": r"LAST of S\d+<", "completion": "Last answer."}],
    "default": {"completion": "Noted, go on."},
    "token_latency_s": 0.001,
}


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


class RedisServer:
    """A real redis-server on loopback; `persistent`: append-only file, fsynced every second, as deployed."""

    def __init__(self, data_dir: Path, persistent: bool = True) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server not installed (scripts/install_test_deps.sh)")
        self.binary, self.dir, self.port = binary, data_dir, find_free_port()
        self.persistent = persistent
        self.proc: subprocess.Popen | None = None
        data_dir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        cmd = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.dir), "--save", ""]
        cmd += ["--appendonly", "yes", "--appendfsync", "everysec"] if self.persistent else ["--appendonly", "no"]
        log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 - the server writes to it for its lifetime
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        log.close()
        import redis

        r = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 60
        while True:
            try:
                info = r.info("server")
                r.ping()
                break
            except redis.exceptions.ConnectionError:  # not up yet, or loading its data back (LOADING)
                assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        assert Path(info["executable"]).name == "redis-server" and info["process_id"] == self.proc.pid
        r.close()

    def stop(self) -> None:
        """SIGTERM: with persistence on, redis writes its append-only file out and exits."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
            self.proc = None

    def restart(self, down_s: float = 1.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()


def start_engine(ckpt: Path, work: Path, script: dict[str, Any] = SCRIPT) -> tuple[ManagedProcess, str, Path]:
    """The scripted fake engine, logging every request: (process, URL, request log)."""
    (work / "script.json").write_text(json.dumps(script))
    log, port = work / "engine.jsonl", find_free_port()
    cmd = [sys.executable, "-m", "sim.fake_sglang", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--engine", "scripted", "--script", str(work / "script.json"), "--model-path", str(ckpt)]
    proc = ManagedProcess.start(cmd + ["--request-log", str(log)], name="fake engine", log_path=str(work / "e.log"))
    proc.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=120, port=port)
    return proc, f"http://127.0.0.1:{port}", log


@dataclass
class GatewayProcess:
    """One `slime gateway`; `kill` is SIGKILL (a crash), `start` again binds the same port."""

    engine_url: str
    ckpt: Path
    store: str
    log_path: Path
    extra: list[str] = field(default_factory=list)
    port: int = field(default_factory=find_free_port)
    proc: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "slime.cli", "gateway", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--engine-url", self.engine_url, "--hf-checkpoint", str(self.ckpt), "--admin-token", ADMIN]
        self.proc = ManagedProcess.start(
            cmd + ["--store", self.store, *self.extra], name="gateway", log_path=str(self.log_path)
        )
        self.proc.wait_healthy(f"{self.url}/health", timeout=120, port=self.port)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()

    def stop(self) -> int | None:
        return stop_popen(self.proc.proc, 10.0) if self.proc is not None else None


class RetryingClient:
    """An agent client's retries: on a connection error it fails over to the other gateway, on a retryable
    status it backs off and tries again; every error it saw is counted by kind."""

    def __init__(self, http: httpx.AsyncClient, urls: list[str], deadline_s: float = 120.0) -> None:
        self.http, self.urls, self.deadline_s = http, urls, deadline_s
        self.errors: Counter[str] = Counter()

    async def post(
        self, path: str, prefer: int, body: Any = None, key: str | None = None
    ) -> tuple[httpx.Response, int]:
        """(the answer, how many attempts it took); raises on a non-retryable answer."""
        headers = {"Authorization": f"Bearer {key or ADMIN}"}
        delay, t0, at = 0.05, time.monotonic(), prefer
        for attempt in range(1, 10_000):
            url = self.urls[at % len(self.urls)]
            try:
                r = await self.http.post(f"{url}{path}", json=body, headers=headers)
            except httpx.TransportError as e:
                self.errors[f"connection: {type(e).__name__}"] += 1
                at += 1  # that process is gone: the other one
            else:
                if r.status_code == 200:
                    return r, attempt
                kind = "retryable" if r.status_code in RETRYABLE else "NOT retryable"
                self.errors[f"{kind}: {r.status_code} {r.text[:80]}"] += 1
                if r.status_code not in RETRYABLE:
                    raise RuntimeError(f"{path}: {r.status_code} {r.text[:300]}")
            if time.monotonic() - t0 > self.deadline_s:
                raise TimeoutError(f"{path}: no answer within {self.deadline_s}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        raise AssertionError("unreachable")


def engine_calls(log: Path) -> dict[str, list[dict[str, Any]]]:
    """The engine's /generate calls by session id (rid = '<session id>-<gateway tag><n>')."""
    out: dict[str, list[dict[str, Any]]] = {}
    for line in log.read_text().splitlines():
        c = json.loads(line)
        if c["endpoint"] == "/generate" and c.get("responses"):
            out.setdefault(c["body"]["rid"].rsplit("-", 1)[0], []).append(c)
    return out


def trajectory_problem(samples: list[dict[str, Any]], calls: list[dict[str, Any]], turns: int) -> str | None:
    """None when the finished session is one segment of `turns` sampled spans, each exactly one engine call's
    output right after exactly that call's prompt; else what is wrong (lost, duplicated, or inexact)."""
    if len(samples) != 1:
        return f"{len(samples)} segments (a retry made a wipe?)"
    s = samples[0]
    if s["metadata"]["num_turns"] != turns or s["metadata"]["num_drifts"]:
        return f"{s['metadata']['num_turns']} turns, {s['metadata']['num_drifts']} drifts"
    tokens, p = s["tokens"], s["prompt_length"]
    mask = [0] * p + s["loss_mask"]
    spans, start = [], None
    for k, m in enumerate(mask + [0]):
        if m and start is None:
            start = k
        elif not m and start is not None:
            spans.append((start, k))
            start = None
    if len(spans) != turns:
        return f"{len(spans)} sampled spans for {turns} turns"
    sampled = {(tuple(c["body"]["input_ids"]), tuple(c["responses"][0]["output_ids"])) for c in calls}
    for a, b in spans:
        if (tuple(tokens[:a]), tuple(tokens[a:b])) not in sampled:
            return f"span {a}:{b} is no engine call's output after its prompt"
    return None
