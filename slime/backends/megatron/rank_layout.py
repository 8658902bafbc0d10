"""Megatron's rank layout, recomputed from first principles so simulated ranks sit where real ones would.

A global rank is a mixed-radix number whose digits are the per-dimension ranks, least significant digit
first in `order` (default `tp-cp-ep-dp-pp`: TP neighbours are adjacent ranks, PP stages are farthest
apart). A group along a set of dimensions holds every rank that shares the digits of all *other*
dimensions. Group enumeration order and the order of ranks inside a group follow megatron-core 0.16.1
(`megatron/core/parallel_state.py`: `RankGenerator.get_ranks`, `initialize_model_parallel`), which the
property tests check; this module does not import megatron. `slime plan` prints the train ranks with it, and
the simulator places its ranks with it.
"""

from __future__ import annotations

import itertools
import logging
import math

logger = logging.getLogger(__name__)

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
_TOKENS = ("tp", "cp", "ep", "dp", "pp")

# Dense groups exposed by `rank_groups`: our dim name -> the dimensions it spans.
_DENSE_GROUPS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "pp": ("pp",),
    "dp": ("dp",),
    "cp": ("cp",),
    "ep": ("ep",),
    "dp_cp": ("dp", "cp"),
    "mp": ("tp", "pp"),
    "tp_cp": ("tp", "cp"),
    "tp_dp": ("tp", "dp"),
    "tp_dp_cp": ("tp", "dp", "cp"),
}

# Expert groups, as megatron builds them from its second (expert) generator, where its "tp" is the
# expert tensor-parallel size and its "dp" the expert data-parallel size.
_EXPERT_GROUPS: dict[str, tuple[str, ...]] = {
    "ep": ("ep",),
    "etp": ("tp",),
    "edp": ("dp",),
    "tp_ep": ("tp", "ep"),
    "tp_ep_pp": ("tp", "ep", "pp"),
    "pp": ("pp",),
}


def _parse_order(order: str, sizes: dict[str, int]) -> list[str]:
    """Tokens of `order`, with unnamed size-1 dimensions appended (they change nothing)."""
    tokens = order.lower().split("-")
    unknown = [t for t in tokens if t not in _TOKENS]
    if unknown or len(set(tokens)) != len(tokens):
        raise ValueError(f"bad parallel order {order!r}: tokens must be distinct names from {_TOKENS}")
    for name in _TOKENS:
        if name not in tokens:
            if sizes[name] != 1:
                raise ValueError(f"order {order!r} omits {name!r}, whose size is {sizes[name]} (not 1)")
            tokens.append(name)
    return tokens


def masked_groups(sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """All groups spanning the masked digits of a mixed-radix rank (first digit least significant).

    Groups are listed by the mixed-radix value of their fixed (unmasked) digits; ranks inside a group by
    the mixed-radix value of their masked digits — both least-significant-first.
    """
    strides = [math.prod(sizes[:i]) for i in range(len(sizes))]
    inside = [i for i, m in enumerate(mask) if m]
    outside = [i for i, m in enumerate(mask) if not m]

    def digit_tuples(axes: list[int]) -> list[tuple[int, ...]]:
        # itertools.product varies the last element fastest; reverse so the first axis varies fastest.
        return [tuple(reversed(t)) for t in itertools.product(*(range(sizes[a]) for a in reversed(axes)))]

    groups = []
    for fixed in digit_tuples(outside):
        base = sum(d * strides[a] for d, a in zip(fixed, outside, strict=True))
        groups.append(
            [base + sum(d * strides[a] for d, a in zip(free, inside, strict=True)) for free in digit_tuples(inside)]
        )
    return groups


def _groups_for(sizes: dict[str, int], order: str, wanted: dict[str, tuple[str, ...]]) -> dict[str, list[list[int]]]:
    tokens = _parse_order(order, sizes)
    ordered_sizes = [sizes[t] for t in tokens]
    return {name: masked_groups(ordered_sizes, [t in dims for t in tokens]) for name, dims in wanted.items()}


def _check_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def rank_groups(
    world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, order: str = DEFAULT_ORDER
) -> dict[str, list[list[int]]]:
    """Every group of each dimension for a world split as tp × cp × ep × dp × pp (dp derived).

    Keys: tp, pp, dp, cp, ep, dp_cp, mp (= tp-pp, Megatron's model-parallel group), tp_cp, tp_dp,
    tp_dp_cp. Megatron itself builds its dense groups with ep=1 and takes ep from the expert layout
    (`expert_rank_groups`); ep > 1 here gives the generic layout, equal to `RankGenerator(tp, ep, dp,
    pp, cp, order)`, which megatron only accepts with cp == 1.
    """
    _check_positive(world_size=world_size, tp=tp, pp=pp, cp=cp, ep=ep)
    model = tp * pp * cp * ep
    if world_size % model:
        raise ValueError(f"world_size {world_size} is not divisible by tp*pp*cp*ep = {tp}*{pp}*{cp}*{ep} = {model}")
    sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": world_size // model, "pp": pp}
    return _groups_for(sizes, order, _DENSE_GROUPS)


def expert_rank_groups(
    world_size: int, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, order: str = DEFAULT_ORDER
) -> dict[str, list[list[int]]]:
    """Expert-layer groups as megatron's `initialize_model_parallel` builds them.

    Megatron lays expert weights out with a second rank generator: tensor size = etp (defaults to tp),
    expert size = ep, cp = 1, data size = world / (etp * ep * pp) (the "expert data parallel" group that
    averages expert gradients). Keys: ep, etp, edp, tp_ep, tp_ep_pp, pp.
    """
    etp = tp if etp is None else etp
    _check_positive(world_size=world_size, tp=tp, pp=pp, ep=ep, etp=etp)
    model = etp * ep * pp
    if world_size % model:
        raise ValueError(
            f"world_size {world_size} is not divisible by etp*ep*pp = {etp}*{ep}*{pp} = {model} (expert layout)"
        )
    sizes = {"tp": etp, "cp": 1, "ep": ep, "dp": world_size // model, "pp": pp}
    return _groups_for(sizes, order, _EXPERT_GROUPS)


def rank_of(groups: list[list[int]], world_size: int) -> list[tuple[int, int]]:
    """For each global rank: (index of its group, its position in that group)."""
    where: list[tuple[int, int] | None] = [None] * world_size
    for gi, group in enumerate(groups):
        for pos, r in enumerate(group):
            where[r] = (gi, pos)
    missing = [r for r, w in enumerate(where) if w is None]
    if missing:
        raise ValueError(f"groups do not cover ranks {missing[:8]}")
    return where  # type: ignore[return-value]
