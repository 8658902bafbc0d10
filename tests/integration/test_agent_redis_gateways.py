"""Two `slime gateway` processes sharing a real `redis-server` on loopback serve the same sessions: each
session's turns alternate between the processes and `finish` is called on the other one. Nothing may be lost
or mixed: every session's merged sample holds exactly its own engine calls, token for token.

20 sessions x 10 turns here; `ci/redis.sh stress 100` runs 100 (SLIME_REDIS_STRESS_SESSIONS) and its result is
recorded in docs/agent.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sim.fake_sglang.scripted_engine import scripted_logprob
from sim.fake_sglang.testing import launch_fake_sglang, stop_process
from slime.utils.http_utils import find_free_port
from slime.utils.process import ManagedProcess

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

N_SESSIONS = int(os.environ.get("SLIME_REDIS_STRESS_SESSIONS", "20"))
N_TURNS = 10
ADMIN = "admin-t"
SCRIPT = {
    "rules": [{"match": r"T9 of S\d+<", "completion": "Last answer."}],
    "default": {"completion": "Noted, go on."},
    "token_latency_s": 0.001,
}


@pytest.fixture
def redis_url() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server not installed (apt-get install -y redis-server)")
    port = find_free_port()
    cmd = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        import redis

        r = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 30
        while True:
            try:
                info = r.info("server")
                break
            except redis.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        # the real server, not a stand-in
        assert info["redis_version"] and Path(info["executable"]).name == "redis-server"
        assert info["process_id"] == proc.pid
        r.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_process(proc)


def start_gateway(engine_url: str, ckpt: Path, store: str) -> tuple[subprocess.Popen, str]:
    port = find_free_port()
    cmd = [sys.executable, "-m", "slime.cli", "gateway", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--engine-url", engine_url, "--hf-checkpoint", str(ckpt), "--admin-token", ADMIN, "--store", store]
    gateway = ManagedProcess.start(cmd, name="gateway")
    url = f"http://127.0.0.1:{port}"
    gateway.wait_healthy(f"{url}/health", timeout=120)
    return gateway.proc, url


async def one_session(c: httpx.AsyncClient, urls: list[str], i: int) -> dict[str, Any]:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    sess = (await c.post(f"{urls[i % 2]}/admin/sessions", json={"metadata": {"i": i}}, headers=admin)).json()
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"Session S{i}."}]
    for t in range(N_TURNS):
        messages.append({"role": "user", "content": f"T{t} of S{i}"})
        url = urls[(i + t) % 2]  # turns alternate between the two processes
        r = await c.post(
            f"{url}/v1/chat/completions",
            json={"model": "m", "messages": messages},
            headers={"Authorization": f"Bearer {sess['api_key']}"},
        )
        assert r.status_code == 200, r.text
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    last = (i + N_TURNS - 1) % 2
    done = await c.post(f"{urls[1 - last]}/admin/sessions/{sess['session_id']}/finish", headers=admin)
    assert done.status_code == 200, done.text
    late = await c.post(  # the session is finished for every process
        f"{urls[last]}/v1/chat/completions",
        json={"model": "m", "messages": messages + [{"role": "user", "content": "again"}]},
        headers={"Authorization": f"Bearer {sess['api_key']}"},
    )
    assert late.status_code == 409, late.text
    return {"i": i, "session_id": sess["session_id"], "samples": done.json()["samples"]}


def check_session(res: dict[str, Any], calls: list[dict[str, Any]], tok: Any) -> None:
    sid, i = res["session_id"], res["i"]
    mine = [c for c in calls if str(c["body"]["rid"]).startswith(sid + "-")]
    assert len(mine) == N_TURNS, f"S{i}: {len(mine)} engine calls"
    (s,) = res["samples"]  # one chain, appended turn after turn: one segment
    assert s["metadata"]["segment_kind"] == "final" and s["metadata"]["num_turns"] == N_TURNS
    tokens, p = s["tokens"], s["prompt_length"]
    mask = [0] * p + s["loss_mask"]
    lps = [0.0] * p + s["rollout_log_probs"]
    expected: set[int] = set()
    for c in mine:
        inp, out = c["body"]["input_ids"], c["responses"][0]["output_ids"]
        assert tokens[: len(inp)] == inp and tokens[len(inp) : len(inp) + len(out)] == out
        for j, t in enumerate(out):
            expected.add(len(inp) + j)
            assert lps[len(inp) + j] == pytest.approx(scripted_logprob(t, j))
    assert {k for k, m in enumerate(mask) if m} == expected
    text = tok.decode(tokens)
    assert f"Session S{i}." in text and text.count(" of S") == N_TURNS
    assert all(f"T{t} of S{i}<" in text for t in range(N_TURNS))  # only this session's turns
    assert text.rstrip().endswith("Last answer.<|im_end|>")


def test_two_gateway_processes_share_sessions_through_redis(redis_url: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from sim.tiny_checkpoint import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "tiny")
    (tmp_path / "script.json").write_text(json.dumps(SCRIPT))
    log = tmp_path / "engine.jsonl"
    args = ["--engine", "scripted", "--script", str(tmp_path / "script.json"), "--model-path", str(ckpt)]
    procs: list[subprocess.Popen] = []
    with launch_fake_sglang(args + ["--request-log", str(log)]) as eng:
        try:
            urls = []
            for _ in range(2):
                proc, url = start_gateway(eng.url, ckpt, redis_url)
                procs.append(proc)
                urls.append(url)

            async def main() -> list[dict[str, Any]]:
                limits = httpx.Limits(max_connections=64)
                async with httpx.AsyncClient(timeout=120, limits=limits) as c:
                    return await asyncio.gather(*(one_session(c, urls, i) for i in range(N_SESSIONS)))

            t0 = time.monotonic()
            results = asyncio.run(main())
            elapsed = time.monotonic() - t0
        finally:
            for p in procs:
                assert stop_process(p) == 0
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    calls = [c for c in calls if c["endpoint"] == "/generate"]
    assert len(calls) == N_SESSIONS * N_TURNS
    tok = AutoTokenizer.from_pretrained(ckpt)
    for res in results:
        check_session(res, calls, tok)
    print(f"redis store: {N_SESSIONS} sessions x {N_TURNS} turns over 2 gateway processes in {elapsed:.1f}s")
