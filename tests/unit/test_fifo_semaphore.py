"""`FifoSemaphore` (slime/utils/fifo_semaphore.py): the rollout semaphore's contract under random arrivals,
holds and cancellations — never more holders than permits, first come first served, no permit lost."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slime.utils.fifo_semaphore import FifoSemaphore
from tests.hypothesis_budget import examples

pytestmark = pytest.mark.cpu


@settings(max_examples=examples(200), deadline=None)
@given(
    st.integers(1, 4),
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.booleans()), min_size=1, max_size=30),
)
def test_holders_never_exceed_permits_and_order_is_kept(value, jobs):
    async def main() -> None:
        sem = FifoSemaphore(value)
        holding, order, tasks = [0], [], []

        async def job(i: int, hold: int) -> None:
            async with sem:
                holding[0] += 1
                try:
                    assert holding[0] <= value
                    order.append(i)
                    for _ in range(hold):
                        await asyncio.sleep(0)
                finally:  # cancelled while holding: it still gives the permit back
                    holding[0] -= 1

        for i, (delay, hold, cancel) in enumerate(jobs):
            tasks.append((asyncio.create_task(job(i, hold)), cancel, delay))
        for t, cancel, delay in tasks:
            for _ in range(delay):
                await asyncio.sleep(0)
            if cancel:
                t.cancel()
        await asyncio.gather(*(t for t, _, _ in tasks), return_exceptions=True)
        assert holding[0] == 0
        # every permit came back: `value` tasks can hold it at once again
        got = 0

        async def take() -> None:
            nonlocal got
            await sem.acquire()
            got += 1

        takers = [asyncio.create_task(take()) for _ in range(value)]
        await asyncio.wait_for(asyncio.gather(*takers), 5)
        assert got == value and sem.locked()
        assert order == sorted(order), "a later arrival went first"

    asyncio.run(main())
