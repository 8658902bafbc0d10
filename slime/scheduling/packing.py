"""Bin packing and balanced partitioning used by the step schedule.

Kept separate from `schedule.py` because these are generic algorithms on lists of weights: the schedule
decides *what* to pack (one optimizer step's samples) and with which capacity; these functions only pack.
All results are lists of indices into the input, each inner list sorted ascending, and deterministic.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence

logger = logging.getLogger(__name__)


def first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """One first-fit pass in input order; an item longer than `capacity` gets a bin of its own.

    Input order is kept (no sorting) so a group's segments tend to land in the same micro-batch, which keeps
    packed sequences contiguous; an oversize item's bin is already over capacity, so nothing joins it.
    """
    if capacity <= 0:
        raise ValueError(f"first_fit: capacity must be positive, got {capacity}")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i, n in enumerate(lengths):
        for b, load in enumerate(loads):
            if load + n <= capacity:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    return bins


def split_bins(bins: list[list[int]], lengths: Sequence[int], target: int) -> list[list[int]]:
    """Split the heaviest multi-item bins in two until there are `target` bins (or none can be split).

    Splitting never raises a bin's load, so the capacity invariant of `first_fit` survives. Halves are
    balanced greedily by weight (heaviest item to the lighter half) so the new micro-batches stay even.
    """
    bins = [list(b) for b in bins]
    while len(bins) < target:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            break
        b = max(splittable, key=lambda j: (sum(lengths[i] for i in bins[j]), -j))
        halves: tuple[list[int], list[int]] = ([], [])
        loads = [0, 0]
        for i in sorted(bins[b], key=lambda i: (-lengths[i], i)):
            h = 0 if loads[0] <= loads[1] else 1
            halves[h].append(i)
            loads[h] += lengths[i]
        bins[b] = sorted(halves[0])
        bins.insert(b + 1, sorted(halves[1]))
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
