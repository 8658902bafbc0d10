"""Bin packing and balanced partitioning used by the step schedule.

Kept separate from `schedule.py` because these are generic algorithms on lists of weights: the schedule
decides *what* to pack (one optimizer step's samples) and with which capacity; these functions only pack.
All results are lists of indices into the input, each inner list sorted ascending, and deterministic.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Hashable, Iterable, Sequence

logger = logging.getLogger(__name__)


# A sample's prompt for prompt sharing: (identity of its prompt tokens, prompt length), or None when it shares
# nothing. Samples of one micro-batch with the same identity are packed with the prompt once (the trainer's
# `--share-prompt-prefix`), so the micro-batch's token load counts that prompt once.
Prompt = tuple[Hashable, int] | None


class _Bin:
    """A micro-batch being filled: its items, its packed load, and the prompts it already holds."""

    __slots__ = ("items", "load", "_keys", "_lengths", "_prompts")

    def __init__(self, lengths: Sequence[int], prompts: Sequence[Prompt] | None) -> None:
        self.items: list[int] = []
        self.load = 0
        self._keys: set[Hashable] = set()
        self._lengths = lengths
        self._prompts = prompts

    def _prompt(self, i: int) -> Prompt:
        return self._prompts[i] if self._prompts is not None else None

    def cost(self, i: int) -> int:
        p = self._prompt(i)
        return self._lengths[i] - p[1] if p is not None and p[0] in self._keys else self._lengths[i]

    def add(self, i: int) -> None:
        self.load += self.cost(i)
        self.items.append(i)
        p = self._prompt(i)
        if p is not None:
            self._keys.add(p[0])


def packed_load(items: Iterable[int], lengths: Sequence[int], prompts: Sequence[Prompt] | None = None) -> int:
    """Tokens a micro-batch of `items` occupies: every sample's length, less each repeat of a shared prompt."""
    b = _Bin(lengths, prompts)
    for i in items:
        b.add(i)
    return b.load


def first_fit(lengths: Sequence[int], capacity: int, prompts: Sequence[Prompt] | None = None) -> list[list[int]]:
    """One first-fit pass in input order; an item longer than `capacity` gets a bin of its own.

    Input order is kept (no sorting) so a group's segments tend to land in the same micro-batch, which keeps
    packed sequences contiguous; an oversize item's bin is already over capacity, so nothing joins it. With
    `prompts`, an item whose prompt a bin already holds costs that bin only its response.
    """
    if capacity <= 0:
        raise ValueError(f"first_fit: capacity must be positive, got {capacity}")
    bins: list[_Bin] = []
    for i in range(len(lengths)):
        target = next((b for b in bins if b.load + b.cost(i) <= capacity), None)
        if target is None:
            target = _Bin(lengths, prompts)
            bins.append(target)
        target.add(i)
    return [b.items for b in bins]


def _split_units(items: list[int], prompts: Sequence[Prompt] | None) -> list[list[int]]:
    """The pieces a bin is split along: its prompt groups when it holds several (each half then holds a prompt
    once), else single items."""
    if prompts is None:
        return [[i] for i in items]
    units: dict[Hashable, list[int]] = {}
    for i in items:
        p = prompts[i]
        units.setdefault(p[0] if p is not None else ("item", i), []).append(i)
    return list(units.values()) if len(units) > 1 else [[i] for i in items]


def split_bins(
    bins: list[list[int]], lengths: Sequence[int], target: int, prompts: Sequence[Prompt] | None = None
) -> list[list[int]]:
    """Split the heaviest multi-item bins in two until there are `target` bins (or none can be split).

    Splitting never raises a bin's load (a half holds a subset of the bin's prompts too), so the capacity
    invariant of `first_fit` survives. Halves are balanced greedily by load (heaviest piece to the lighter
    half) so the new micro-batches stay even.
    """
    bins = [list(b) for b in bins]
    while len(bins) < target:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            break
        b = max(splittable, key=lambda j: (packed_load(bins[j], lengths, prompts), -j))
        units = _split_units(bins[b], prompts)
        weights = [packed_load(u, lengths, prompts) for u in units]
        halves = (_Bin(lengths, prompts), _Bin(lengths, prompts))
        for u in sorted(range(len(units)), key=lambda u: (-weights[u], units[u][0])):
            half = halves[0] if halves[0].load <= halves[1].load else halves[1]
            for i in units[u]:
                half.add(i)
        bins[b] = sorted(halves[0].items)
        bins.insert(b + 1, sorted(halves[1].items))
    return bins


def karmarkar_karp(weights: Sequence[float], k: int, *, equal_size: bool = True) -> list[list[int]]:
    """Partition indices of `weights` into `k` sets with near-equal sums (largest differencing method).

    With `equal_size` every set gets exactly len(weights)/k items (each rank must run the same number of
    micro-batches, which pipeline parallelism requires). Partial solutions are k-tuples of (sum, items)
    sorted heaviest first; the two with the largest spread are merged heaviest-with-lightest.
    """
    n = len(weights)
    if k <= 0:
        raise ValueError(f"karmarkar_karp: k must be positive, got {k}")
    if equal_size and n % k:
        raise ValueError(f"karmarkar_karp: {n} items cannot be split into {k} sets of equal size")
    order = sorted(range(n), key=lambda i: (-weights[i], i))
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    counter = 0

    def push(state: list[tuple[float, list[int]]]) -> None:
        nonlocal counter
        state.sort(key=lambda s: (-s[0], s[1]))
        heapq.heappush(heap, (-(state[0][0] - state[-1][0]), counter, state))
        counter += 1

    if equal_size:
        for c in range(0, n, k):
            push([(float(weights[i]), [i]) for i in order[c : c + k]])
    else:
        for i in order:
            push([(float(weights[i]), [i])] + [(0.0, []) for _ in range(k - 1)])
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        push([(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)])
    return [sorted(items) for _, items in heap[0][2]]
