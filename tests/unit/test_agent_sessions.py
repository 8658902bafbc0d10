"""PromptBuilder + Session: new / append (exact token reuse) / re-render with drift / wipe, on the tiny
checkpoint's real tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime.agent.api import ApiRequest
from slime.agent.chains import RequestHints
from slime.agent.context_limit import ContextLimit
from slime.agent.parsing import parse_model_output
from slime.agent.prompts import PromptBuilder, canonical_assistant, parsed_to_message
from slime.agent.requests import measure
from slime.agent.session import MAIN, ChainTurn, Session
from slime.agent.trajectory import TurnRecord

pytestmark = pytest.mark.cpu

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "f", "description": "", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def builder(tmp_path_factory: pytest.TempPathFactory) -> PromptBuilder:
    from transformers import AutoTokenizer

    from sim.tiny_checkpoint import build_tiny_checkpoint

    ckpt: Path = build_tiny_checkpoint(tmp_path_factory.mktemp("sess") / "tiny")
    return PromptBuilder(AutoTokenizer.from_pretrained(ckpt))


def _turn(b: PromptBuilder, s: Session, messages: list, completion: str) -> tuple[str, list[int]]:
    req = ApiRequest("/chat/completions", messages, TOOLS, {}, RequestHints(), None, False)
    req = measure(req, b, ContextLimit(1 << 20, None), count=False)
    action, ids = b.plan(s.last_turn(MAIN), req)
    if action == "wipe":
        s.freeze(MAIN, "wipe")
    out = b.encode(completion) + [b.eos_id]
    parsed = parse_model_output(completion, ["f"])
    rec = TurnRecord(ids, out, [-0.1] * len(out))
    s.add_turn(
        MAIN, ChainTurn(rec, req.hashes, req.tools_hash, req.text, canonical_assistant(parsed_to_message(parsed)))
    )
    return action, ids


def test_append_reuses_sampled_tokens_exactly(builder: PromptBuilder) -> None:
    s = Session("s", "k")
    msgs = [{"role": "user", "content": "go"}]
    assert _turn(builder, s, msgs, "<think>\nhmm\n</think>\n\n" + CALL)[0] == "new"
    # the client drops the reasoning and re-sends JSON arguments: still our message, so our tokens are reused
    msgs += [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
        },
        {"role": "tool", "content": "42"},
    ]
    action, ids = _turn(builder, s, msgs, "The answer is 42.")
    first = s.chain[0].record
    assert (
        action == "append"
        and ids[: len(first.prompt_ids) + len(first.output_ids)] == first.prompt_ids + first.output_ids
    )
    (seg,) = s.segments()
    assert sum(seg.loss_mask) == len(first.output_ids) + len(s.chain[1].record.output_ids)
    assert seg.metadata["num_drifts"] == 0


def test_edited_assistant_message_is_rerendered_and_masked(builder: PromptBuilder) -> None:
    s = Session("s", "k")
    msgs = [{"role": "user", "content": "go"}]
    _turn(builder, s, msgs, "first answer")
    msgs += [{"role": "assistant", "content": "an edited answer"}, {"role": "user", "content": "more"}]
    action, _ = _turn(builder, s, msgs, "second")
    assert action == "append_rerendered"
    (seg,) = s.segments()
    assert seg.metadata["num_drifts"] == 1
    assert sum(seg.loss_mask) == len(s.chain[1].record.output_ids)  # the edited first answer is not trained


def test_rewritten_history_wipes_into_its_own_segment(builder: PromptBuilder) -> None:
    s = Session("s", "k")
    _turn(builder, s, [{"role": "user", "content": "go"}], "one")
    action, _ = _turn(builder, s, [{"role": "user", "content": "summary of earlier work"}], "two")
    assert action == "wipe"
    segs = s.segments()
    assert [g.metadata["segment_kind"] for g in segs] == ["wipe", "final"]
    assert all(sum(g.loss_mask) > 0 for g in segs)
