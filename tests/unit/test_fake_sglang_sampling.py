"""The fake's sampler draws from the truncated distribution but reports full-vocabulary log-probs (SGLang)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.fake_sglang.sampling import filter_probs, sample_batch, sample_one
from tests.hypothesis_budget import examples

pytestmark = pytest.mark.cpu

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])


def _expected(temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    return filter_probs(torch.softmax(LOGITS / temperature, -1), top_p=top_p, top_k=top_k)


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"), [(1.0, 1.0, -1), (0.7, 1.0, -1), (1.0, 0.8, -1), (1.3, 1.0, 3)]
)
def test_empirical_frequencies_match_expected_distribution(temperature, top_p, top_k):
    n = 6000
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(len(LOGITS))
    full = torch.log_softmax(LOGITS / temperature, -1)
    for _ in range(n):
        tok, lp = sample_one(LOGITS, temperature=temperature, top_p=top_p, top_k=top_k, generator=gen)
        counts[tok] += 1
        assert lp == pytest.approx(float(full[tok]), abs=1e-6)  # not renormalised by top-p/top-k
    expected = _expected(temperature, top_p, top_k)
    assert torch.all(counts[expected == 0] == 0)
    keep = expected > 0
    chi2 = float((((counts - n * expected) ** 2)[keep] / (n * expected[keep])).sum())
    dof = int(keep.sum()) - 1
    # 99.9th percentile of chi-square is below dof + 6*sqrt(2*dof) + 10 for these small dof.
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, counts, expected)


def test_greedy_and_top_k_one_use_plain_log_softmax():
    tok, lp = sample_one(LOGITS, temperature=0.0)
    assert tok == 0 and lp == pytest.approx(float(torch.log_softmax(LOGITS, -1)[0]))
    tok, lp = sample_one(LOGITS, temperature=0.5, top_k=1)
    assert tok == 0 and lp == pytest.approx(float(torch.log_softmax(LOGITS / 0.5, -1)[0]))


def test_same_generator_seed_same_draws():
    a = [sample_one(LOGITS, temperature=1.0, generator=torch.Generator().manual_seed(7))[0] for _ in range(5)]
    g = torch.Generator().manual_seed(7)
    b = [sample_one(LOGITS, temperature=1.0, generator=g)[0] for _ in range(1)]
    assert a[0] == b[0] and len(set(a)) == 1


@settings(max_examples=examples(200), deadline=None)
@given(
    logits=st.lists(st.floats(-5, 5), min_size=2, max_size=12),
    top_p=st.floats(0.05, 1.0),
    top_k=st.integers(-1, 12).filter(lambda k: k != 0),
    min_p=st.floats(0.0, 0.9),
)
def test_filter_probs_is_a_distribution_containing_the_argmax(logits, top_p, top_k, min_p):
    probs = torch.softmax(torch.tensor(logits, dtype=torch.float32), -1)
    out = filter_probs(probs, top_p=top_p, top_k=top_k, min_p=min_p)
    assert float(out.sum()) == pytest.approx(1.0, abs=1e-5)
    assert torch.all(out >= 0)
    assert out[int(torch.argmax(probs))] > 0
    if 0 < top_k < len(logits):
        kth = torch.sort(probs, descending=True).values[top_k - 1]
        assert torch.all(probs[out > 0] >= kth)
    # Kept tokens keep their relative odds.
    kept = out > 0
    ratio = out[kept] / probs[kept]
    assert torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-4)


@settings(max_examples=examples(200), deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.5]),  # temperature (0: greedy)
            st.sampled_from([1.0, 0.9, 0.5]),  # top_p
            st.sampled_from([-1, 1, 3]),  # top_k
            st.sampled_from([0.0, 0.1]),  # min_p
            st.integers(0, 2**31 - 1),  # sampling seed
        ),
        min_size=1,
        max_size=8,
    ),
    draws=st.integers(1, 4),
    data=st.data(),
)
def test_batched_sampling_equals_each_row_alone(rows, draws, data):
    """A request's tokens and log-probs do not depend on the rows it is batched with (own generator each)."""
    vocab = 16
    logits = torch.tensor(
        data.draw(
            st.lists(
                st.lists(st.floats(-4, 4), min_size=vocab, max_size=vocab), min_size=len(rows), max_size=len(rows)
            )
        )
    )
    params = [r[:4] for r in rows]
    batch_gens = [torch.Generator().manual_seed(r[4]) for r in rows]
    alone_gens = [torch.Generator().manual_seed(r[4]) for r in rows]
    for _ in range(draws):  # several steps: each generator's stream advances once per step
        got = sample_batch(logits, params, batch_gens)
        for i, (t, p, k, m, _) in enumerate(rows):
            tok, lp = sample_one(logits[i], temperature=t, top_p=p, top_k=k, min_p=m, generator=alone_gens[i])
            assert got[i][0] == tok
            assert got[i][1] == pytest.approx(lp, abs=1e-6)
            scale = t if t >= 1e-6 else 1.0  # full-vocabulary log-prob of the drawn token (SGLang's)
            assert lp == pytest.approx(float(torch.log_softmax(logits[i] / scale, -1)[tok]), abs=1e-5)
