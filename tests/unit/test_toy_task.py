"""Toy quick-start task: disjoint deterministic splits, row format, the reward table, and the full prepare CLI."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from examples.toy.prepare import PROMPT_PREFIX, main, make_splits, prepare
from examples.toy.reward import reverse_digits_rm, score_reverse
from slime.rollout.rm_hub import async_rm
from slime.utils.types import Sample

pytestmark = pytest.mark.cpu


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _digits(row):
    return row["input"][0]["content"].removeprefix(PROMPT_PREFIX)


def test_splits_disjoint_lengths_and_labels(tmp_path):
    paths = prepare(tmp_path, num_train=300, num_eval=50, seed=3, build_model=False)
    train, evaluation = _read(paths["train"]), _read(paths["eval"])
    assert (len(train), len(evaluation)) == (300, 50)
    train_prompts = {r["input"][0]["content"] for r in train}
    eval_prompts = {r["input"][0]["content"] for r in evaluation}
    assert len(train_prompts) == 300 and len(eval_prompts) == 50
    assert not train_prompts & eval_prompts
    for row in train + evaluation:
        digits = _digits(row)
        assert digits.isdigit() and 6 <= len(digits) <= 8
        assert row["label"] == digits[::-1] and row["label"][0] != "0"
        assert row["input"] == [{"role": "user", "content": PROMPT_PREFIX + digits}]
        assert row["metadata"] == {"rm_type": "math", "num_digits": len(digits)}
    assert {len(_digits(r)) for r in train} == {6, 7, 8}


def test_splits_deterministic_by_seed():
    assert make_splits(100, 20, seed=0) == make_splits(100, 20, seed=0)
    assert make_splits(100, 20, seed=0) != make_splits(100, 20, seed=1)


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("3627184", "3627184", 1.0),
        ("The answer is 3627184.", "3627184", 1.0),
        ("3627000", "3627184", 4 / 7),
        ("4817263", "3627184", 1 / 7),  # unreversed: only the middle digit matches
        ("3627", "3627184", 4 / 7),  # missing digits are wrong positions
        ("362718499", "3627184", 7 / 9),  # extra digits too
        ("36 27184", "3627184", 2 / 7),  # first digit run only
        ("", "3627184", 0.0),
        ("no digits here", "3627184", 0.0),
        ("<think>1234567</think>3627184", "3627184", 1.0),  # closed reasoning is skipped
        ("３６２", "362", 0.0),  # fullwidth digits are not ASCII digits: no answer
    ],
)
def test_reward_table(response, label, expected):
    assert score_reverse(response, label) == pytest.approx(expected)


def test_reward_through_custom_rm_path(make_args: Callable[..., Any]):
    args = make_args(custom_rm_path="examples.toy.reward.reverse_digits_rm")
    sample = Sample(response="297000", label="297267", metadata={"rm_type": "math"})
    assert asyncio.run(async_rm(args, sample)) == pytest.approx(0.5)
    assert asyncio.run(reverse_digits_rm(args, sample)) == pytest.approx(0.5)


def test_prepare_cli_builds_model_and_chat_prompt(tmp_path, capsys):
    from transformers import AutoTokenizer

    main(["--out", str(tmp_path), "--num-train", "16", "--num-eval", "4", "--seed", "0"])
    assert "train:" in capsys.readouterr().out
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert len(tok) <= 512
    row = _read(tmp_path / "data" / "train.jsonl")[0]
    text = tok.apply_chat_template(row["input"], tokenize=False, add_generation_prompt=True)
    assert text == f"<|im_start|>user\n{row['input'][0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # byte-level BPE round-trips the prompt
