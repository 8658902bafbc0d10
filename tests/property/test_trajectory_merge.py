"""Property tests of `merge_turns`: exact prefix merging, and conservative masking under drift.

Model of an agent chain: turn k's prompt is P0 + r(O1) + T1 + ... + r(Ok-1) + Tk-1, where Oj is what the
engine sampled at turn j, Tj the tool / template tokens added after it and r(Oj) its rendering in later
prompts: Oj itself, or (drift) a re-tokenisation that first differs at some position inside Oj.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slime.agent.trajectory import TurnRecord, merge_turns
from tests.hypothesis_budget import examples

pytestmark = pytest.mark.cpu

ids = st.lists(st.integers(0, 50), min_size=1, max_size=8)


@st.composite
def chains(draw: st.DrawFn, drift: bool) -> tuple[list[TurnRecord], list[list[int]], list[bool]]:
    n = draw(st.integers(1, 6))
    p0 = draw(ids)
    outs = [draw(ids) for _ in range(n)]
    tools = [draw(st.lists(st.integers(100, 120), min_size=0, max_size=5)) for _ in range(n)]
    renders, drifted = [], []
    for o in outs:
        if drift and draw(st.booleans()):
            cut = draw(st.integers(0, len(o) - 1))
            alt = draw(st.lists(st.integers(60, 90), min_size=1, max_size=4))  # disjoint from sampled ids
            renders.append(o[:cut] + alt)
            drifted.append(True)
        else:
            renders.append(list(o))
            drifted.append(False)
    turns, prompt = [], list(p0)
    for k in range(n):
        lps = [-(0.01 + ((7 * t + 3 * j) % 11) / 10) for j, t in enumerate(outs[k])]
        turns.append(TurnRecord(list(prompt), list(outs[k]), lps, "stop"))
        prompt = prompt + renders[k] + tools[k]
    return turns, outs, drifted


def _stream(seg):
    tokens = list(seg.prompt_ids) + list(seg.response_ids)
    p = len(seg.prompt_ids)
    return tokens, [0] * p + list(seg.loss_mask), [0.0] * p + list(seg.rollout_log_probs)


@settings(max_examples=examples(300), deadline=None)
@given(chains(drift=False))
def test_no_drift_every_sampled_token_trained_once(chain) -> None:
    turns, outs, _ = chain
    (seg,) = merge_turns(turns)
    tokens, mask, lps = _stream(seg)
    last = turns[-1]
    assert tokens == last.prompt_ids + last.output_ids
    trained = [i for i, m in enumerate(mask) if m]
    expected = [len(t.prompt_ids) + j for t in turns for j in range(len(t.output_ids))]
    assert trained == expected  # each sampled token exactly once, nothing else
    for t in turns:
        for j, lp in enumerate(t.output_log_probs):
            assert lps[len(t.prompt_ids) + j] == lp
    assert seg.metadata["num_drifts"] == 0


@settings(max_examples=examples(300), deadline=None)
@given(chains(drift=True))
def test_drift_only_exact_context_targets_survive(chain) -> None:
    turns, outs, drifted = chain
    (seg,) = merge_turns(turns)
    tokens, mask, lps = _stream(seg)
    assert tokens == turns[-1].prompt_ids + turns[-1].output_ids  # the stream is the final context
    for i, m in enumerate(mask):
        if not m:
            assert lps[i] == 0.0
            continue
        # a trained token was sampled by some turn in exactly this context, with its own log-prob
        owners = [
            (t, i - len(t.prompt_ids))
            for t in turns
            if len(t.prompt_ids) <= i < len(t.prompt_ids) + len(t.output_ids)
            and tokens[: i + 1] == (t.prompt_ids + t.output_ids)[: i + 1]
        ]
        assert owners and any(lps[i] == t.output_log_probs[j] for t, j in owners)
    # only the drifted spans are lost (the last output can never drift: nothing renders it again)
    kept = sum(len(o) for o, d in zip(outs[:-1], drifted[:-1], strict=True) if not d) + len(outs[-1])
    assert sum(mask) == kept
    assert seg.metadata["num_drifts"] == sum(drifted[:-1])


@settings(max_examples=examples(200), deadline=None)
@given(chains(drift=False), ids)
def test_rewritten_prompt_base_starts_a_new_segment(chain, other) -> None:
    turns, outs, _ = chain
    fresh = TurnRecord([999] + other, [7, 8], [-0.5, -0.5], "stop")
    segs = merge_turns(turns + [fresh])
    assert len(segs) == 2  # nothing sampled before the rewrite is dropped
    assert sum(segs[0].loss_mask) == sum(len(o) for o in outs) and segs[1].response_ids == [7, 8]
