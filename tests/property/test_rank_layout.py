"""sim's rank layout equals megatron-core's `RankGenerator` (imported only here) for random valid configs."""

from __future__ import annotations

import itertools
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fake_megatron import SimulatedWorld, expert_rank_groups, rank_groups

pytestmark = pytest.mark.cpu

N_EXAMPLES = settings().max_examples  # from the profile: 200 under CI=true (tests/hypothesis_budget.py)
MAX_WORLD = 64
DENSE_TOKENS = {
    "tp": "tp",
    "pp": "pp",
    "dp": "dp",
    "cp": "cp",
    "ep": "ep",
    "dp_cp": "dp-cp",
    "mp": "tp-pp",
    "tp_cp": "tp-cp",
    "tp_dp": "tp-dp",
    "tp_dp_cp": "tp-dp-cp",
}
EXPERT_TOKENS = {"ep": "ep", "etp": "tp", "edp": "dp", "tp_ep": "tp-ep", "tp_ep_pp": "tp-ep-pp", "pp": "pp"}


@pytest.fixture(scope="module")
def RankGenerator():  # noqa: N802 - it is a class
    # ~7 s import; once per module. It warns that TransformerEngine/Apex are absent, which is expected here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.parallel_state import RankGenerator

    return RankGenerator


def _factor(draw, limit: int) -> int:
    return draw(st.sampled_from([d for d in (1, 2, 3, 4, 8) if d <= limit]))


@st.composite
def dense_configs(draw):
    """(tp, pp, cp, ep, dp) with world <= 64 and megatron's rule `ep == 1 or cp == 1`."""
    tp = _factor(draw, MAX_WORLD)
    pp = _factor(draw, MAX_WORLD // tp)
    rest = MAX_WORLD // (tp * pp)
    if draw(st.booleans()):
        cp, ep = _factor(draw, rest), 1
    else:
        cp, ep = 1, _factor(draw, rest)
    dp = draw(st.integers(1, MAX_WORLD // (tp * pp * cp * ep)))
    return tp, pp, cp, ep, dp


@st.composite
def expert_configs(draw):
    """(world, tp, pp, cp, ep, etp): a valid dense world plus expert sizes dividing it, as megatron requires."""
    tp, pp, cp, _, dp = draw(dense_configs())
    world = tp * pp * cp * dp
    options = [(e, t) for e in range(1, world + 1) for t in range(1, world + 1) if world % (e * t * pp) == 0]
    ep, etp = draw(st.sampled_from(options))
    return world, tp, pp, cp, ep, etp


ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "cp", "ep", "dp", "pp"))]


@settings(max_examples=N_EXAMPLES, deadline=None)
@given(cfg=dense_configs(), order=st.one_of(st.just("tp-cp-ep-dp-pp"), st.sampled_from(ORDERS)))
def test_dense_layout_equals_megatron(RankGenerator, cfg, order):  # noqa: N803
    tp, pp, cp, ep, dp = cfg
    world = tp * pp * cp * ep * dp
    ours = rank_groups(world, tp=tp, pp=pp, cp=cp, ep=ep, order=order)
    gen = RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order)
    assert set(ours) == set(DENSE_TOKENS)
    for name, token in DENSE_TOKENS.items():
        assert ours[name] == gen.get_ranks(token), (name, cfg, order)
    for name in ("tp", "pp", "dp", "cp", "ep"):  # every single-dim family partitions the world
        assert sorted(r for g in ours[name] for r in g) == list(range(world))


@settings(max_examples=N_EXAMPLES, deadline=None)
@given(cfg=expert_configs())
def test_expert_layout_and_world_equal_megatron(RankGenerator, cfg):  # noqa: N803
    world, tp, pp, cp, ep, etp = cfg
    # What megatron-core 0.16.1's initialize_model_parallel builds (parallel_state.py): a dense generator
    # with ep=1 and an expert generator with tp=etp, cp=1, dp=world/(etp*ep*pp).
    dense_gen = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    expert_gen = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")

    ours = expert_rank_groups(world, tp=tp, pp=pp, ep=ep, etp=etp)
    for name, token in EXPERT_TOKENS.items():
        assert ours[name] == expert_gen.get_ranks(token), (name, cfg)

    sim = SimulatedWorld(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    dense_dims = {
        "tp": "tp",
        "pp": "pp",
        "dp": "dp",
        "cp": "cp",
        "dp_cp": "dp-cp",
        "mp": "tp-pp",
        "tp_dp_cp": "tp-dp-cp",
    }
    for dim, token in dense_dims.items():
        assert sim.groups(dim) == dense_gen.get_ranks(token), (dim, cfg)
    for dim, token in {"ep": "ep", "etp": "tp", "edp": "dp"}.items():
        assert sim.groups(dim) == expert_gen.get_ranks(token), (dim, cfg)
    assert (sim.dp, sim.edp) == (world // (tp * pp * cp), world // (etp * ep * pp))


def test_probe_example_layout():
    """The world=8, tp=2, pp=2 layout in megatron-core 0.16.1's default order (tp-cp-ep-dp-pp), spelled out by hand."""
    g = rank_groups(8, tp=2, pp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp"] == g["dp_cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g["tp_dp_cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    e = expert_rank_groups(8, tp=2, pp=2, ep=2)
    assert e["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert e["tp_ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(world_size=6, tp=4), "not divisible by tp"),
        (dict(world_size=8, tp=2, ep=3), "expert layout"),
        (dict(world_size=8, tp=0), "positive integer"),
    ],
)
def test_invalid_worlds_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SimulatedWorld(**kwargs)


def test_order_must_name_non_trivial_dims():
    with pytest.raises(ValueError, match="omits 'cp'"):
        rank_groups(8, tp=2, cp=2, order="tp-dp-pp")
    assert rank_groups(8, tp=2, order="tp-dp-pp")["dp"] == rank_groups(8, tp=2)["dp"]
