"""Simulated collectives agree with a sequential reference, bit for bit, and failures never hang."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fake_megatron import CollectiveError, CollectiveTimeout, SimulatedWorld
from slime.parallel_state import ParallelState

pytestmark = pytest.mark.cpu

N_EXAMPLES = settings().max_examples  # from the profile: 200 under CI=true (tests/hypothesis_budget.py)
DIMS = ("tp", "pp", "dp", "cp", "ep", "etp", "dp_cp", "mp", "edp", "tp_dp_cp")
OPS = ("sum", "max", "min", "avg")


@st.composite
def worlds(draw, max_world: int = 16):
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2]))
    cp = draw(st.sampled_from([1, 2]))
    dp = draw(st.integers(1, max(1, max_world // (tp * pp * cp))))
    world = tp * pp * cp * dp
    ep, etp = draw(st.sampled_from([(e, t) for e in (1, 2, 4) for t in (1, 2) if world % (e * t * pp) == 0]))
    return SimulatedWorld(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, timeout_s=30)


@st.composite
def programs(draw):
    """A random list of collectives that every rank executes in the same order."""
    steps = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["all_reduce", "all_gather", "broadcast", "reduce_scatter", "barrier"]))
        dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.int64]))
        op = draw(st.sampled_from(OPS if dtype.is_floating_point else ("sum", "max", "min")))
        rows = draw(st.integers(1, 3))
        cols = draw(st.integers(1, 4))
        steps.append(
            dict(
                kind=kind,
                dim=draw(st.sampled_from(DIMS)),
                op=op,
                dtype=dtype,
                rows=rows,
                cols=cols,
                src=draw(st.integers(0, 63)),
                seed=draw(st.integers(0, 2**31 - 1)),
            )
        )
    return steps


def _input(step: dict, rank: int, group_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step["seed"] + 7919 * rank)
    rows = step["rows"] * group_size if step["kind"] == "reduce_scatter" else step["rows"]
    if step["dtype"].is_floating_point:
        return torch.randn(rows, step["cols"], generator=g, dtype=step["dtype"]) * 1e3
    return torch.randint(-1000, 1000, (rows, step["cols"]), generator=g, dtype=step["dtype"])


def _reference(step: dict, world: SimulatedWorld, rank: int):
    """What `rank` must get, computed sequentially over its group in group-rank order."""
    group = next(g for g in world.groups(step["dim"]) if rank in g)
    xs = [_input(step, r, len(group)) for r in group]
    kind, op = step["kind"], step["op"]
    if kind == "barrier":
        return None
    if kind == "all_gather":
        return xs
    if kind == "broadcast":
        return xs[step["src"] % len(group)]
    acc = xs[0].clone()
    for x in xs[1:]:
        acc = acc + x if op in ("sum", "avg") else (torch.maximum(acc, x) if op == "max" else torch.minimum(acc, x))
    if op == "avg":
        acc = acc / len(group)
    if kind == "reduce_scatter":
        return acc.chunk(len(group))[group.index(rank)]
    return acc


def _execute(step: dict, ps: ParallelState):
    n = ps.size(step["dim"])
    x = _input(step, ps.global_rank, n)
    kind = step["kind"]
    if kind == "all_reduce":
        out = ps.all_reduce(x, op=step["op"], dim=step["dim"])
        assert out is x  # in place when no grad is involved
        return x
    if kind == "all_gather":
        return ps.all_gather(x, dim=step["dim"])
    if kind == "broadcast":
        return ps.broadcast(x, src=step["src"] % n, dim=step["dim"])
    if kind == "reduce_scatter":
        return ps.reduce_scatter(x, op=step["op"], dim=step["dim"])
    return ps.barrier(dim=step["dim"])


@settings(max_examples=N_EXAMPLES, deadline=None)
@given(world=worlds(), program=programs())
def test_collectives_match_sequential_reference(world, program):
    results = world.run(lambda ps: [_execute(step, ps) for step in program])
    for rank, per_rank in enumerate(results):
        for step, got in zip(program, per_rank, strict=True):
            want = _reference(step, world, rank)
            if isinstance(want, list):
                assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), step
            elif want is None:
                assert got is None
            else:
                assert got.dtype == want.dtype and torch.equal(got, want), (rank, step)


@settings(max_examples=N_EXAMPLES, deadline=None)
@given(world=worlds())
def test_topology_queries_are_consistent(world):
    def probe(ps):
        assert isinstance(ps, ParallelState)
        return {d: (ps.size(d), ps.rank(d), ps.group(d)) for d in DIMS}

    for rank, info in enumerate(world.run(probe)):
        for dim, (size, local, group) in info.items():
            assert list(group) in world.groups(dim)
            assert size == len(group) == world.size(dim)
            assert group[local] == rank


def test_sixty_four_ranks_reduce_identically():
    world = SimulatedWorld(64, tp=2, pp=2, cp=2, ep=4)

    def fn(ps):
        t = torch.full((3,), 0.1 * (ps.global_rank + 1), dtype=torch.float32)
        for dim in ("dp_cp", "tp", "pp", "ep", "edp"):
            ps.all_reduce(t, "avg", dim)
        return t

    out = world.run(fn)
    assert all(torch.equal(out[0], t) for t in out)  # one reduction order for everyone: identical bits
    assert torch.allclose(out[0], torch.full((3,), 0.1 * 65 / 2))


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_all_reduce_gradient_flows_like_torch_distributed_nn(op):
    world = SimulatedWorld(4, tp=2)

    def fn(ps):
        x = torch.tensor([float(ps.global_rank + 1), 2.0], requires_grad=True)
        y = ps.all_reduce(x * x, op=op, dim="tp")
        (y * torch.tensor([1.0, 3.0])).sum().backward()
        return y.detach(), x.grad

    out = world.run(fn)
    n = 2
    for group in world.groups("tp"):
        xs = [torch.tensor([float(r + 1), 2.0]) for r in group]
        y = sum(x * x for x in xs) / (n if op == "avg" else 1)
        for r in group:
            assert torch.equal(out[r][0], y)
            # Every rank's loss depends on every x: dL/dx_r = sum over ranks of w * d(y)/d(x_r).
            expected = n * torch.tensor([1.0, 3.0]) * 2 * xs[group.index(r)] / (n if op == "avg" else 1)
            assert torch.allclose(out[r][1], expected)


def test_exception_on_one_rank_propagates_without_hanging():
    world = SimulatedWorld(8, tp=2, cp=2, timeout_s=30)
    reached = threading.Event()

    def fn(ps):
        if ps.global_rank == 5:
            reached.wait(5)
            raise KeyError("boom on five")
        reached.set()
        ps.barrier("dp_cp")
        ps.all_reduce(torch.ones(2), dim="tp")
        return ps.global_rank

    with pytest.raises(KeyError, match="boom on five") as info:
        world.run(fn)
    assert any("rank 5" in note for note in info.value.__notes__)
    assert world.run(lambda ps: ps.global_rank) == list(range(8))  # the world is reusable afterwards


def test_rank_returning_early_is_reported():
    world = SimulatedWorld(4, tp=2, timeout_s=30)

    def fn(ps):
        if ps.global_rank != 3:
            ps.all_reduce(torch.ones(1), dim="dp")

    with pytest.raises(CollectiveError, match="already returned"):
        world.run(fn)


def test_mismatched_collectives_fail_on_every_rank():
    world = SimulatedWorld(2)

    def fn(ps):
        if ps.global_rank == 0:
            return ps.all_reduce(torch.ones(2), "sum", "dp")
        return ps.all_reduce(torch.ones(3), "sum", "dp")

    with pytest.raises(CollectiveError, match="mismatched collective"):
        world.run(fn)


def test_crossed_collective_order_times_out():
    # tp groups [0,1],[2,3]; dp groups [0,2],[1,3]. Ranks 0 and 3 go dp-first, 1 and 2 tp-first: a cycle.
    world = SimulatedWorld(4, tp=2, timeout_s=0.3)

    def fn(ps):
        dims = ("dp", "tp") if ps.global_rank in (0, 3) else ("tp", "dp")
        for d in dims:
            ps.barrier(d)

    with pytest.raises(CollectiveTimeout, match="never joined"):
        world.run(fn)


def test_bad_arguments_raise_on_all_ranks():
    world = SimulatedWorld(2)
    with pytest.raises(ValueError, match="divisible"):
        world.run(lambda ps: ps.reduce_scatter(torch.ones(3), dim="dp"))
    with pytest.raises(ValueError, match="unknown reduce op"):
        world.run(lambda ps: ps.all_reduce(torch.ones(1), op="prod"))
    with pytest.raises(TypeError, match="floating"):
        world.run(lambda ps: ps.all_reduce(torch.ones(1, dtype=torch.int64), op="avg"))
    with pytest.raises(ValueError, match="unknown parallel dim"):
        world.run(lambda ps: ps.size("xp"))
