"""Chain routing (pure): sub-agent chains opened by the task prompt and closed by the tool result, parallel
sub-agents, auxiliary small/fast-model calls, rewritten histories, and hint extraction from protocol bodies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime.agent.chains import (
    AUX_CHAIN,
    RequestHints,
    anthropic_hints,
    chat_hints,
    register_subagent_calls,
    responses_hints,
    route,
)
from slime.agent.parsing import ParsedOutput, ToolCall
from slime.agent.session import MAIN, ChainTurn, Session
from slime.agent.trajectory import TurnRecord

pytestmark = pytest.mark.cpu

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "agent" / "claude_code_subagent.jsonl"


def add(s: Session, cid: str, hashes: list[str], out: list[int] | None = None) -> None:
    prev = s.last_turn(cid)
    prompt = (prev.record.prompt_ids + prev.record.output_ids if prev else [100]) + [len(hashes)]
    out = out or [7, 8]
    s.add_turn(cid, ChainTurn(TurnRecord(prompt, out, [-0.5] * len(out)), hashes, "th", "", {}))


def agent_call(prompt: str) -> ParsedOutput:
    return ParsedOutput(None, "", [ToolCall("Agent", {"description": "d", "prompt": prompt})])


def test_subagent_chain_opens_on_prompt_and_freezes_on_tool_result() -> None:
    s = Session("sess-a", "k")
    main = ["sys", "task"]
    assert route(s, RequestHints(is_subagent=False, first_user_texts=("task",)), main) == MAIN
    add(s, MAIN, main)
    register_subagent_calls(s, MAIN, "sess-a-x1", agent_call("write hello.txt"))
    assert s.pending == {"sess-a-x1_0": ["write hello.txt", MAIN]}

    sub1 = ["subsys", "reminder+write hello.txt"]
    hints = RequestHints(
        is_subagent=True, first_user_texts=("<system-reminder>x</system-reminder>", "write hello.txt")
    )
    cid = route(s, hints, sub1)
    assert cid == "sub:sess-a-x1_0" and not s.pending
    add(s, cid, sub1)
    sub2 = sub1 + ["a1", "tool1"]
    assert route(s, hints, sub2) == cid  # continues its own chain, not main
    add(s, cid, sub2)

    # the parent gets the sub-agent's result: the sub chain freezes as one `subagent` context
    back = main + ["agent_call", "agent_result"]
    hints_main = RequestHints(is_subagent=False, first_user_texts=("task",), tool_result_ids=("toolu_sess-a-x1_0",))
    assert route(s, hints_main, back) == MAIN
    add(s, MAIN, back)
    assert cid not in s.chains and s.frozen == [("subagent", cid, [1, 2])]
    segs = s.segments()
    assert [g.metadata["segment_kind"] for g in segs] == ["subagent", "final"]
    assert [g.metadata["num_turns"] for g in segs] == [2, 2]
    assert segs[0].metadata["chain"] == cid and segs[1].metadata["chain"] == MAIN


def test_parallel_subagents_get_one_chain_each_even_with_equal_prompts() -> None:
    s = Session("sess-b", "k")
    add(s, MAIN, ["sys", "task"])
    parsed = ParsedOutput(None, "", [ToolCall("Task", {"prompt": "p"}), ToolCall("Task", {"prompt": "p"})])
    register_subagent_calls(s, MAIN, "r1", parsed)
    hints = RequestHints(is_subagent=True, first_user_texts=("p",))
    first = route(s, hints, ["subsys", "p"])
    add(s, first, ["subsys", "p"])
    second = route(s, hints, ["subsys", "p"])  # same messages as the first one's turn: still a new sub-agent
    assert {first, second} == {"sub:r1_0", "sub:r1_1"}
    add(s, second, ["subsys", "p"])
    assert route(s, hints, ["subsys", "p", "a", "t"]) in (first, second)
    assert sorted(g.metadata["chain"] for g in s.segments()) == [MAIN, "sub:r1_0", "sub:r1_1"]


def test_main_agent_request_with_the_task_text_is_not_a_subagent() -> None:
    s = Session("sess-c", "k")
    add(s, MAIN, ["sys", "task"])
    register_subagent_calls(s, MAIN, "r1", agent_call("p"))
    # billing block says "not a sub-agent": a rewritten main history, whatever its first message says
    assert route(s, RequestHints(is_subagent=False, first_user_texts=("p",)), ["sys2", "p"]) == MAIN
    assert s.pending  # still waiting for the real sub-agent


def test_auxiliary_model_calls_are_their_own_untrained_segment() -> None:
    s = Session("sess-d", "k")
    add(s, MAIN, ["sys", "task"])
    aux = RequestHints(model="small-fast")
    assert route(s, aux, ["sys", "task", "more"], aux_models={"small-fast"}) == AUX_CHAIN  # even if it extends main
    add(s, AUX_CHAIN, ["sys", "task", "more"])
    assert route(s, RequestHints(model="policy"), ["sys", "task", "x", "y"], aux_models={"small-fast"}) == MAIN
    segs = s.segments()
    assert [g.metadata["segment_kind"] for g in segs] == ["auxiliary", "final"]
    assert set(segs[0].loss_mask) == {0} and set(segs[0].rollout_log_probs) == {0.0}
    assert set(segs[1].loss_mask) == {1}
    assert s.wipe_kind(AUX_CHAIN) == "auxiliary" and s.wipe_kind(MAIN) == "wipe"


def test_rewritten_or_repeated_history_goes_to_main_for_the_plan_to_wipe() -> None:
    s = Session("sess-e", "k")
    add(s, MAIN, ["sys", "task"])
    assert route(s, RequestHints(), ["sys", "summary"]) == MAIN
    assert route(s, RequestHints(), ["sys", "task"]) == MAIN
    s.freeze(MAIN, "wipe")
    add(s, MAIN, ["sys", "summary"])
    assert [g.metadata["segment_kind"] for g in s.segments()] == ["wipe", "final"]


def test_marked_subagent_without_pending_call_gets_its_own_chain() -> None:
    s = Session("sess-f", "k")
    add(s, MAIN, ["sys", "task"])
    cid = route(s, RequestHints(is_subagent=True, first_user_texts=("unknown job",)), ["subsys", "unknown job"])
    assert cid.startswith("sub:?") and s.chains[cid].kind == "subagent"


def test_hints_from_a_real_claude_code_capture() -> None:
    # Claude Code 2.1.197 against the gateway: main (Agent call), sub-agent x2, main again (tool result)
    posts = [json.loads(x)["body"] for x in FIXTURE.read_text().splitlines()]
    main, sub, back = anthropic_hints(posts[0]), anthropic_hints(posts[1]), anthropic_hints(posts[3])
    assert main.is_subagent is False and sub.is_subagent is True and back.is_subagent is False
    assert main.model == sub.model == "slime-policy"
    assert "SUBJOB-42: create sub.txt" in sub.first_user_texts and len(sub.first_user_texts) == 2
    agent_use = [b for m in posts[3]["messages"] if m["role"] == "assistant" for b in m["content"]]
    assert back.tool_result_ids == (agent_use[0]["id"],) and agent_use[0]["name"] == "Agent"
    sdk = anthropic_hints({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert sdk.is_subagent is None and sdk.first_user_texts == ("hi",)


def test_hints_from_openai_bodies() -> None:
    chat = chat_hints(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "go"}]},
                {"role": "tool", "tool_call_id": "call_r_0", "content": "x"},
            ],
        }
    )
    assert chat == RequestHints("m", None, ("go",), ("call_r_0",))
    resp = responses_hints(
        {
            "model": "m",
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "dev"}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]},
                {"type": "custom_tool_call_output", "call_id": "call_r_1", "output": "ok"},
            ],
        }
    )
    assert resp == RequestHints("m", None, ("go",), ("call_r_1",))
    assert responses_hints({"input": "hi"}).first_user_texts == ("hi",)
