"""On-policy distillation: A_t ← A_t − coef·(ℓ_student,t − ℓ_teacher,t), after the estimator and before whitening;
teacher log-probs carried from `Sample.teacher_log_probs` into the train data and through CP slicing; flags."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime.algorithms.advantages import compute_advantages_and_returns
from slime.algorithms.cp_slicing import slice_response_for_cp, unslice_response_from_cp
from slime.algorithms.loss import policy_loss_function
from slime.algorithms.opd import apply_opd
from slime.arguments import default_args, validate_args
from slime.ray.train_data import samples_to_train_data
from slime.rollout.model_scoring import mean_log_probs, response_log_probs, scoring_request
from slime.utils.errors import SlimeArgError
from slime.utils.types import Sample, Status
from tests.hypothesis_budget import examples

pytestmark = pytest.mark.cpu

finite = st.floats(-8.0, 0.0, allow_nan=False, width=32)


@st.composite
def batches(draw):
    n = draw(st.integers(1, 5))
    lens = [draw(st.integers(1, 7)) for _ in range(n)]
    prompts = [draw(st.integers(1, 5)) for _ in range(n)]

    def col():
        return [torch.tensor(draw(st.lists(finite, min_size=k, max_size=k)), dtype=torch.float32) for k in lens]

    return {
        "rewards": draw(st.lists(st.floats(-1, 1, width=32), min_size=n, max_size=n)),
        "loss_masks": [
            torch.tensor(draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=k, max_size=k))) for k in lens
        ],  # fmt: skip
        "total_lengths": [p + k for p, k in zip(prompts, lens, strict=True)],
        "response_lengths": lens,
        "log_probs": col(),
        "ref_log_probs": col(),
        "teacher_log_probs": col(),
    }


def _args(**kw):
    return default_args(**{"advantage_estimator": "grpo", "use_opd": True, "opd_type": "sglang", **kw})


@settings(max_examples=examples(200), deadline=None)
@given(batch=batches(), coef=st.floats(0.0, 4.0), est=st.sampled_from(["grpo", "reinforce_plus_plus_baseline"]))
def test_opd_advantages_equal_a_per_token_loop(batch, coef, est):
    plain = compute_advantages_and_returns(default_args(advantage_estimator=est), dict(batch))[0]
    got = compute_advantages_and_returns(_args(advantage_estimator=est, opd_kl_coef=coef), dict(batch))[0]
    for a, g, s, t in zip(plain, got, batch["log_probs"], batch["teacher_log_probs"], strict=True):
        for j in range(len(a)):
            want = float(a[j]) - coef * (float(s[j]) - float(t[j]))
            assert abs(float(g[j]) - want) < 1e-5 * (1 + abs(want))


@settings(max_examples=examples(100), deadline=None)
@given(batch=batches(), coef=st.floats(0.0, 4.0))
def test_teacher_equal_to_student_changes_nothing_exactly(batch, coef):
    batch["teacher_log_probs"] = [x.clone() for x in batch["log_probs"]]
    plain = compute_advantages_and_returns(default_args(), dict(batch))[0]
    got = compute_advantages_and_returns(_args(opd_kl_coef=coef), dict(batch))[0]
    assert all(torch.equal(a, g) for a, g in zip(plain, got, strict=True))


@settings(max_examples=examples(100), deadline=None)
@given(batch=batches(), cp=st.integers(1, 4), coef=st.floats(0.0, 2.0))
def test_opd_on_cp_slices_equals_opd_on_whole_responses(batch, cp, coef):
    whole = apply_opd([torch.zeros(k) for k in batch["response_lengths"]], batch["log_probs"],
                      batch["teacher_log_probs"], coef)  # fmt: skip
    for i, (t, r) in enumerate(zip(batch["total_lengths"], batch["response_lengths"], strict=True)):
        parts = []
        for rank in range(cp):
            cut = [slice_response_for_cp(batch[k][i], t, r, cp, rank) for k in ("log_probs", "teacher_log_probs")]
            parts.append(apply_opd([torch.zeros(len(cut[0]))], [cut[0]], [cut[1]], coef)[0])
        assert torch.equal(unslice_response_from_cp(parts, t, r, cp), whole[i])


def test_opd_comes_before_whitening():
    batch = {"rewards": [1.0, 0.0], "loss_masks": [torch.ones(2), torch.ones(2)], "total_lengths": [3, 3],
             "response_lengths": [2, 2], "log_probs": [torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0])],
             "teacher_log_probs": [torch.tensor([-1.0, -1.0]), torch.tensor([-3.0, -1.0])]}  # fmt: skip
    adv = compute_advantages_and_returns(_args(normalize_advantages=True, opd_kl_coef=1.0), batch)[0]
    raw = torch.tensor([1.0 - 0.0, 1.0 + 1.0, 0.0 - 2.0, 0.0])  # A − (ℓ_s − ℓ_t) per token, then whitened
    want = (raw - raw.mean()) / raw.std()
    assert torch.allclose(torch.cat(adv), want, atol=1e-5)


def test_missing_teacher_log_probs_is_an_error():
    batch = {"rewards": [1.0], "loss_masks": [torch.ones(2)], "total_lengths": [3], "response_lengths": [2],
             "log_probs": [torch.zeros(2)]}  # fmt: skip
    with pytest.raises(ValueError, match="teacher_log_probs"):
        compute_advantages_and_returns(_args(), batch)


def test_opd_reverse_kl_metric():
    lp = [torch.tensor([-1.0, -2.0], requires_grad=True)]
    batch = {"advantages": [torch.zeros(2)], "loss_masks": [torch.ones(2)], "group_mask_sums": [2.0],
             "total_lengths": [3], "response_lengths": [2], "teacher_log_probs": [torch.tensor([-1.5, -1.0])]}  # fmt: skip
    _, metrics = policy_loss_function(_args(), batch, lp, None)
    assert metrics["opd_reverse_kl"].item() == pytest.approx(((-1.0 + 1.5) + (-2.0 + 1.0)) / 2)


def test_several_teachers_combine_by_their_mean():
    assert mean_log_probs([[-1.0, -2.0], [-3.0, -4.0]]) == [-2.0, -3.0]
    assert mean_log_probs([[-0.5]]) == [-0.5]
    # the term is then the mean of the per-teacher terms
    s, t1, t2 = torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-4.0])
    combined = apply_opd([torch.zeros(1)], [s], [torch.tensor(mean_log_probs([t1.tolist(), t2.tolist()]))], 1.0)
    each = [apply_opd([torch.zeros(1)], [s], [t], 1.0)[0] for t in (t1, t2)]
    assert torch.allclose(combined[0], (each[0] + each[1]) / 2)


def test_scoring_request_and_answer_layout():
    s = Sample(index=3, tokens=[5, 6, 7, 8, 9], response_length=2, status=Status.COMPLETED)
    body = scoring_request([s], 0.7)
    assert body["logprob_start_len"] == 2 and body["sampling_params"] == {"max_new_tokens": 0, "temperature": 0.7}
    answer = {"meta_info": {"input_token_logprobs": [[None, 7, None], [-0.5, 8, None], [-0.25, 9, None]]}}
    assert response_log_probs(answer, s) == [-0.5, -0.25]
    with pytest.raises(ValueError, match="one prompt length"):
        scoring_request([s, Sample(tokens=[1, 2, 3], response_length=1)], 1.0)
    with pytest.raises(RuntimeError, match="sample 3"):
        response_log_probs({"meta_info": {"input_token_logprobs": [[None, 8, None], [-0.25, 9, None]]}}, s)


def test_train_data_carries_teacher_and_ref_log_probs():
    samples = [Sample(group_index=0, index=i, tokens=[1, 2, 3], response_length=2, reward=float(i),
                      status=Status.COMPLETED, teacher_log_probs=[-0.1 * i, -0.2], ref_log_probs=[-1.0, -2.0])
               for i in range(2)]  # fmt: skip
    args = _args(ref_model_name="ref", use_kl_loss=True, n_samples_per_prompt=2)
    data = samples_to_train_data(args, samples)
    assert data["teacher_log_probs"] == [[0.0, -0.2], [-0.1, -0.2]] and data["ref_log_probs"] == [[-1.0, -2.0]] * 2
    assert "teacher_log_probs" not in samples_to_train_data(default_args(n_samples_per_prompt=2), samples)
    samples[1].teacher_log_probs = None
    with pytest.raises(ValueError, match="sample 1: teacher_log_probs"):
        samples_to_train_data(args, samples)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"use_opd": True}, "--use-opd needs --opd-type"),
        ({"use_opd": True, "opd_type": "megatron"}, "needs --opd-teacher-load"),
        ({"opd_type": "sglang"}, "only with --use-opd"),
        ({"use_opd": True, "opd_type": "sglang", "loss_type": "sft_loss"}, "policy_loss only"),
        ({"ref_model_name": "ref"}, "needs a reference policy"),
        ({"ref_model_name": "ref", "use_kl_loss": True, "ref_update_interval": 2}, "trainer-side copy"),
        ({"opd_teacher_ckpt_step": 3}, "not supported yet"),
    ],
)
def test_flag_errors(flags, message, tmp_path):
    from sim.tiny_checkpoint import build_tiny_checkpoint

    ckpt = str(build_tiny_checkpoint(tmp_path / "m"))
    args = default_args(hf_checkpoint=ckpt, rollout_batch_size=1, num_rollout=1, **flags)
    with pytest.raises(SlimeArgError, match=message):
        validate_args(args)
