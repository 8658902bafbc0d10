"""Dynamic-sampling and buffer filters, plus the small async/HTTP helpers the rollout relies on."""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slime.arguments import default_args
from slime.rollout.filter_hub import DynamicFilterOutput, call_dynamic_filter, check_reward_nonzero_std, pop_first
from slime.utils.async_utils import run
from slime.utils.http_utils import find_free_port
from slime.utils.process import ManagedProcess
from slime.utils.types import Sample
from tests.hypothesis_budget import examples

pytestmark = pytest.mark.cpu

ARGS = default_args(reward_key="acc")  # shared by the hypothesis test, which cannot take fixtures


def group(*rewards) -> list[Sample]:
    return [Sample(index=i, reward=r) for i, r in enumerate(rewards)]


def test_check_reward_nonzero_std() -> None:
    assert check_reward_nonzero_std(ARGS, group(0.0, 1.0)) == DynamicFilterOutput(keep=True, reason=None)
    assert check_reward_nonzero_std(ARGS, group(1.0, 1.0, 1.0)) == DynamicFilterOutput(False, "zero_std_1.0")
    assert check_reward_nonzero_std(ARGS, group(0.0, 0.0)).reason == "zero_std_0.0"
    # dict rewards go through --reward-key; fan-out trajectories are judged on all their segments
    assert not check_reward_nonzero_std(ARGS, group({"acc": 1}, {"acc": 1})).keep
    fan = [[Sample(reward=0.5), Sample(reward=0.5)], [Sample(reward=1.0)]]
    assert check_reward_nonzero_std(ARGS, fan).keep


def test_call_dynamic_filter_accepts_legacy_bool() -> None:
    assert call_dynamic_filter(None, ARGS, group(1.0)).keep
    assert call_dynamic_filter(lambda a, g: False, ARGS, group(1.0)) == DynamicFilterOutput(keep=False)
    assert call_dynamic_filter(lambda a, g, **kw: True, ARGS, group(1.0)).keep


@settings(max_examples=examples(200), deadline=None)
@given(size=st.integers(0, 20), n=st.integers(0, 25))
def test_pop_first_takes_oldest_and_leaves_the_rest(size: int, n: int) -> None:
    buffer = [[Sample(index=i)] for i in range(size)]
    original = list(buffer)
    taken = pop_first(ARGS, None, buffer, n)
    assert len(taken) == min(size, n)
    assert taken + buffer == original  # nothing lost, nothing duplicated, order kept


def test_run_from_threads_shares_one_loop() -> None:
    async def loop_id() -> int:
        import asyncio

        return id(asyncio.get_running_loop())

    ids: list[int] = []
    threads = [threading.Thread(target=lambda: ids.append(run(loop_id()))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1 and ids[0] == run(loop_id())

    async def boom() -> None:
        raise ValueError("inner")

    with pytest.raises(ValueError, match="inner"):
        run(boom())


def test_find_free_port_and_wait_for_dead_process(tmp_path: Path) -> None:
    port = find_free_port()
    assert find_free_port(port) > port  # `port` itself was handed out already
    picked = {find_free_port() for _ in range(50)}
    assert len(picked) == 50 and port not in picked  # never the same port twice in one process
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    assert all(20000 <= p < low for p in picked | {port})  # below the range outgoing connections draw from
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    try:
        assert find_free_port(taken.getsockname()[1]) != taken.getsockname()[1]
    finally:
        taken.close()
    log = tmp_path / "child.log"
    child = ManagedProcess.start(
        [sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"], name="child", log_path=str(log)
    )
    with pytest.raises(RuntimeError, match=r"child exited with code 3 during start-up(.|\n)*bad flag"):
        child.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=60)
    sleeper = ManagedProcess.start([sys.executable, "-c", "import time; time.sleep(60)"], name="sleeper")
    with pytest.raises(TimeoutError, match="sleeper not healthy after"):
        sleeper.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=0.3)
    assert not sleeper.alive  # a child that never became healthy is stopped
