"""The bench's toy reward service answers an eval's burst of concurrent requests without resetting any."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from bench.toy_reward_server import ToyRewardServer

pytestmark = pytest.mark.cpu


async def _burst(url: str, n: int) -> list[object]:
    # remote_rm's client: one session, up to 1024 connections at once (slime/rollout/rm_hub/remote.py).
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024)) as session:

        async def one(i: int) -> object:
            label = str(10**6 + i)  # every other answer gets its last digit wrong: reward 6/7
            answer = label if i % 2 else label[:-1] + str((int(label[-1]) + 1) % 10)
            async with session.post(url, json={"prompt": "p", "response": answer, "label": label}) as r:
                return (await r.json())["reward"]

        return await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)


def test_burst_of_an_eval_is_answered_in_full():
    with ToyRewardServer() as srv:
        got = asyncio.run(_burst(srv.url, 2048))
    bad = [g for g in got if not isinstance(g, float)]  # connection resets would show up here
    assert not bad, bad[:3]
    assert got == [1.0 if i % 2 else 6 / 7 for i in range(2048)]
