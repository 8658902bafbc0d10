"""SGLang's radix (prefix) cache as a client sees it: how many prompt tokens a request found cached.

Why: `meta_info.cached_tokens` and `cached_tokens_details` (null when nothing was cached, `{"device", "host"}`
otherwise; python/sglang/srt/managers/scheduler_components/output_streamer.py `get_cached_tokens_details`) follow
the server's history — a prompt seen before is served from the cache — and a fake that always answers 0 / null
never shows a client the object form. Only the bookkeeping is mirrored; the engines compute what they compute.

What SGLang does (python/sglang/srt/managers/schedule_batch.py, mem_cache/radix_cache.py): a request admitted to a
prefill batch matches its prompt against the tree, up to `len(prompt) - 1` tokens (one must be computed) and,
with `return_logprob` and a `logprob_start_len >= 0`, no further than that start (`Req._compute_max_prefix_len`);
the prompt goes into the tree after the prefill (the other requests of the same prefill batch do not see it) and
prompt + output when the request finishes (`cache_finished_req`: the tokens whose keys and values were computed,
all but the last output token). `flush_cache`, a weight update that flushes, and releasing the KV cache empty it.
"""

from __future__ import annotations

from collections.abc import Sequence


class _Node:
    __slots__ = ("children", "key")

    def __init__(self, key: tuple[int, ...] = ()) -> None:
        self.key = key  # the edge's tokens from the parent
        self.children: dict[int, _Node] = {}


class PrefixCache:
    """A radix tree of token sequences; emptied whole when it holds more than `max_tokens` (SGLang evicts least
    recently used pages under memory pressure; the fake only needs a bound)."""

    def __init__(self, max_tokens: int = 1 << 20) -> None:
        self.max_tokens = max_tokens
        self.clear()

    def clear(self) -> None:
        self._root = _Node()
        self.num_tokens = 0

    def match(self, ids: Sequence[int]) -> int:
        """The length of the longest prefix of `ids` the tree holds."""
        node, n = self._root, 0
        while n < len(ids):
            child = node.children.get(ids[n])
            if child is None:
                return n
            k = _common(child.key, ids, n)
            n += k
            if k < len(child.key):
                return n
            node = child
        return n

    def insert(self, ids: Sequence[int]) -> None:
        if len(ids) + self.num_tokens > self.max_tokens:
            self.clear()
        node, n = self._root, 0
        while n < len(ids):
            child = node.children.get(ids[n])
            if child is None:
                node.children[ids[n]] = _Node(tuple(ids[n:]))
                self.num_tokens += len(ids) - n
                return
            k = _common(child.key, ids, n)
            if k < len(child.key):  # split the edge where the sequences part
                head = _Node(child.key[:k])
                child.key = child.key[k:]
                head.children[child.key[0]] = child
                node.children[ids[n]] = head
                child = head
            n += k
            node = child


def _common(key: tuple[int, ...], ids: Sequence[int], start: int) -> int:
    k, limit = 0, min(len(key), len(ids) - start)
    while k < limit and key[k] == ids[start + k]:
        k += 1
    return k


def max_prefix_len(prompt_len: int, return_logprob: bool, logprob_start_len: int) -> int:
    """schedule_batch.py `Req._compute_max_prefix_len` (the scheduler has already turned a -1 start with
    return_logprob into len(prompt), scheduler.py `handle_generate_request`)."""
    limit = prompt_len - 1
    if return_logprob and logprob_start_len >= 0:
        limit = min(limit, logprob_start_len)
    return max(limit, 0)
