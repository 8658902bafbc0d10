"""The scheduling simulator's fluid engine finishes requests when `sim/fake_sglang`'s synthetic engine does.

The synthetic engine (the fake SGLang server's continuous-batching scheduler, stepping token by token) runs here
in-process on the same virtual clock; both get the same arrivals and the same lengths. The fluid model lets a
request join mid-step where the stepping scheduler makes it wait for the next step, so their finish times may
differ by up to a decode step (under one in 200 random cases tried; the test allows two).
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fake_sglang.synthetic_engine import SyntheticEngine, load_config
from sim.scheduling.clock import run_virtual
from sim.scheduling.engines import SimEngine
from sim.workloads.long_tail import Workload

pytestmark = pytest.mark.cpu


async def _synthetic(
    cfg: dict, slots: int, arrivals: list[tuple[float, int]], max_new: int
) -> list[tuple[int, float]]:
    engine = SyntheticEngine(config=cfg, max_running_requests=slots, random_seed=0)
    runner = asyncio.get_running_loop().create_task(engine.run())
    loop = asyncio.get_running_loop()

    async def one(i: int, at: float, seed: int) -> tuple[int, float]:
        await asyncio.sleep(at)
        body = {
            "rid": f"r{i}",
            "input_ids": [1, 2],
            "sampling_params": {"max_new_tokens": max_new, "sampling_seed": seed},
        }
        req = engine.submit(body)
        await req.done.wait()
        return len(req.output_ids), loop.time()

    out = await asyncio.gather(*(one(i, at, seed) for i, (at, seed) in enumerate(arrivals)))
    await engine.stop()
    await runner
    return out


async def _fluid(w: Workload, arrivals: list[tuple[float, int]], lengths: list[int]) -> list[tuple[int, float]]:
    engine = SimEngine(0, w)
    loop = asyncio.get_running_loop()

    async def one(at: float, n: int) -> tuple[int, float]:
        await asyncio.sleep(at)
        tokens, _, _ = await engine.submit(n, "stop", 2).future
        return tokens, loop.time()

    return await asyncio.gather(*(one(at, n) for (at, _), n in zip(arrivals, lengths, strict=True)))


@settings(max_examples=60, deadline=None)
@given(
    slots=st.integers(1, 4),
    step=st.floats(0.01, 0.05),
    per_request=st.floats(0.0, 0.01),
    arrivals=st.lists(st.tuples(st.floats(0.0, 2.0), st.integers(0, 10**6)), min_size=1, max_size=8),
)
def test_fluid_engine_matches_the_synthetic_scheduler(slots, step, per_request, arrivals):
    max_new = 40
    # distinct arrival times: two timers due at the same instant may fire in either order, and then two
    # equally long requests legitimately swap places in the queue
    arrivals = [(at + i * 1e-3, seed) for i, (at, seed) in enumerate(arrivals)]
    cfg = {**load_config(None), "output_len": {"dist": "uniform", "low": 1, "high": 30},
           "token_latency_s": step, "latency_per_running_request_s": per_request}  # fmt: skip
    synthetic = run_virtual(_synthetic(cfg, slots, arrivals, max_new))
    w = Workload(slots_per_engine=slots, decode_step_s=step, decode_step_per_request_s=per_request,
                 prefill_per_token_s=0.0)  # fmt: skip
    fluid = run_virtual(_fluid(w, arrivals, [n for n, _ in synthetic]))
    longest_step = step + per_request * slots
    for (n, t_syn), (m, t_fluid) in zip(synthetic, fluid, strict=True):
        assert n == m
        assert abs(t_syn - t_fluid) <= 2 * longest_step + 1e-6
