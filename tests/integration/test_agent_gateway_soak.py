"""The gateway soak, CI-sized (`bench/gateway_soak.py` runs 1,000 sessions x 10 turns; docs/performance.md):
two `slime gateway` processes on one persistent redis-server, 50 sessions x 5 turns at 16 concurrent, one
gateway SIGKILLed and started again, Redis restarted. Every session finishes with exactly its engine calls'
tokens (nothing lost, nothing duplicated by a retry) and clients see only retryable errors. No timing asserted.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench.gateway_soak import run_soak

pytestmark = [pytest.mark.cpu, pytest.mark.slow]


def test_soak_with_a_gateway_kill_and_a_redis_restart(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (scripts/install_test_deps.sh)")
    r = run_soak(sessions=50, turns=5, concurrency=16, faults=True, work=tmp_path)
    assert [f["fault"].split()[0] for f in sorted(r["faults"], key=lambda f: f["at_turn"])] == [
        "gateway",
        "redis-server",
    ]
    assert r["lost"] == [] and r["inexact_or_duplicated"] == {} and r["finished_exact"] == 50, r
    assert r["non_retryable_errors"] == 0, r["errors_seen"]
    assert any(k.startswith("connection") for k in r["errors_seen"]), r["errors_seen"]  # the kill was felt
    assert r["engine_calls"] >= 250
