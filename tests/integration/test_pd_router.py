"""PD spike, kept as a test: the real sglang-router 0.3.2 in `--pd-disaggregation` mode in front of fake
prefill/decode engines registered at runtime (`POST /workers` with `worker_type` and `bootstrap_port`).

Observed (and asserted here): the router accepts external prefill/decode workers, sends each request to one
prefill and one decode at once with `bootstrap_host`/`bootstrap_port`/`bootstrap_room` injected, and answers
with the decode's response. The fake decode waits for the prefill that carries its room.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from sim.fake_sglang.testing import launch_fake_sglang
from slime.backends.sglang.router import RouterProcess
from slime.utils.http_utils import find_free_port

pytestmark = pytest.mark.cpu

N_REQUESTS = 12
FAST_FAIL = ("--disaggregation-timeout-s", "3")  # a missing prefill fails after 3 s, not 30


def _read_log(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


@pytest.fixture
def synthetic_config(tmp_path: Path) -> Path:
    cfg = tmp_path / "synthetic.yaml"
    cfg.write_text("output_len: {dist: fixed, value: 6}\ntoken_latency_s: {dist: fixed, value: 0.002}\n")
    return cfg


def _fake(cfg: Path, log: Path, *extra: str):
    return launch_fake_sglang(
        ["--engine", "synthetic", "--synthetic-config", str(cfg), "--request-log", str(log), *extra]
    )


def test_real_router_pd_pairs_every_decode_with_one_prefill(
    tmp_path, synthetic_config, make_args: Callable[..., Any]
) -> None:
    assert importlib.metadata.version("sglang-router") == "0.3.2"
    boot = find_free_port()
    args = make_args(router_policy="round_robin")
    logs = {n: tmp_path / f"{n}.jsonl" for n in ("prefill", "decode0", "decode1")}
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(
            _fake(synthetic_config, logs["prefill"], "--disaggregation-mode", "prefill",
                  "--disaggregation-bootstrap-port", str(boot))
        )  # fmt: skip
        decodes = [
            stack.enter_context(
                _fake(synthetic_config, logs[f"decode{i}"], "--disaggregation-mode", "decode", *FAST_FAIL)
            )
            for i in range(2)
        ]
        router = RouterProcess.start(
            args, host="127.0.0.1", port=find_free_port(), pd=True, log_file=str(tmp_path / "r.log")
        )
        stack.callback(router.stop)
        proc = psutil.Process(router.pid)  # the real router retitles itself sglang::router
        assert proc.name().startswith("sglang::router") and any("sglang_router" in m.path for m in proc.memory_maps())
        router.add_worker(prefill.url, worker_type="prefill", bootstrap_port=boot)
        for d in decodes:
            router.add_worker(d.url, worker_type="decode")
        listed = {w["url"]: w for w in router.list_workers()}
        assert listed[prefill.url]["worker_type"] == "prefill" and listed[prefill.url]["bootstrap_port"] == boot
        assert {listed[d.url]["worker_type"] for d in decodes} == {"decode"}

        for i in range(N_REQUESTS):
            body = {"input_ids": [1, 2, 3, i + 4], "sampling_params": {"max_new_tokens": 8}, "return_logprob": True}
            r = httpx.post(f"{router.url}/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            out = r.json()
            assert len(out["output_ids"]) == 6  # the decode's answer (the prefill only makes one token)
            assert len(out["meta_info"]["output_token_logprobs"]) == 6

        # a decode with no prefill behind its room fails loudly instead of generating on its own
        bad = {"input_ids": [9], "sampling_params": {"max_new_tokens": 2}, "bootstrap_host": "127.0.0.1",
               "bootstrap_port": boot, "bootstrap_room": 12345}  # fmt: skip
        direct = httpx.post(f"{decodes[0].url}/generate", json=bad, timeout=60)
        assert direct.status_code == 500 and "no prefill arrived" in direct.text

    pre = [r for r in _read_log(logs["prefill"]) if r["endpoint"] == "/generate"]
    dec = [r for i in range(2) for r in _read_log(logs[f"decode{i}"]) if r["endpoint"] == "/generate"]
    pre_rooms = Counter(r["bootstrap_room"] for r in pre if r["status"] == 200)
    dec_ok = [r for r in dec if r["status"] == 200]
    assert len(dec_ok) == N_REQUESTS and len(pre_rooms) == N_REQUESTS
    for r in dec_ok:
        assert pre_rooms[r["bootstrap_room"]] == 1  # exactly one prefill carried this room
        assert r["paired_prefill"] == prefill.url
        assert r["body"]["bootstrap_port"] == boot and r["body"]["bootstrap_host"] == "127.0.0.1"
    assert {r["bootstrap_room"] for r in dec_ok} == set(pre_rooms)
    assert all(len(r["responses"][0]["output_ids"]) == 1 for r in pre)  # prefill makes only the first token
    # both decodes served (round robin), and the loud failure is in the log
    assert all(any(r["status"] == 200 for r in _read_log(logs[f"decode{i}"])) for i in range(2))
    assert any(r.get("pd_error") for r in dec)
