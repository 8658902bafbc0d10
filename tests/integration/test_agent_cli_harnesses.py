"""The real Claude Code 2.1.197 and Codex 0.171.0 CLIs as harnesses, offline on loopback, driven by the
`scripted` fake engine whose rules answer with tool calls. Each episode goes through the harness's generate
function (fresh workspace, process-group lifecycle, gateway session); the trajectory's mask-1 tokens must be
exactly the engine's sampled ids (read back from the fake's request log).

The CLIs come from `ci/agent_clis.sh` (a missing CLI skips locally; under CI=true a skip is a failure).
Set SLIME_RECAPTURE_FIXTURES=1 to rewrite the committed Claude Code captures in tests/fixtures/agent/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sim.fake_sglang.scripted_engine import scripted_logprob
from sim.fake_sglang.testing import launch_fake_sglang
from slime.agent.embedded import get_embedded_gateway, stop_embedded_gateway
from slime.agent.gateway import Gateway
from slime.agent.harness import claude_code, codex
from slime.agent.harness.cli import find_cli
from slime.arguments import default_args
from slime.utils.async_utils import run
from slime.utils.types import Sample, Status

pytestmark = pytest.mark.cpu

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agent"
VERSIONS = {"claude": "2.1.197 (Claude Code)", "codex": "codex-cli 0.171.0"}


def call(name: str, arguments: dict[str, Any], think: str | None = None) -> str:
    head = f"<think>\n{think}\n</think>\n\n" if think else ""
    return head + "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


PATCH = "*** Begin Patch\n*** Update File: greet.txt\n@@\n-hello\n+hello world\n*** End Patch\n"
SCRIPT = {
    "rules": [
        # Claude Code: Bash, then Write, then the answer
        {"match": r"TASK-CC[\s\S]*File created successfully", "completion": "All done: notes written."},
        {
            "match": r"TASK-CC[\s\S]*Bash completed",
            "completion": call("Write", {"file_path": "notes/hello.txt", "content": "hello from write\n"}),
        },
        {
            "match": "TASK-CC",
            "completion": call(
                "Bash",
                {"command": "mkdir -p notes && echo hi > notes/bash.txt", "description": "d"},
                think="Make the directory first.",
            ),
        },
        # a tool that never ends, one part of it escaped from the CLI's process group
        {
            "match": "TASK-HANG",
            "completion": call(
                "Bash", {"command": "(setsid sleep 30.4322 >/dev/null 2>&1 &) ; sleep 30.4321", "description": "d"}
            ),
        },
        # Claude Code with a sub-agent: main calls Agent, the sub-agent runs Bash
        {"match": r"(TASK-DELEGATE|SUBJOB-42)[\s\S]*<tool_response>", "completion": "Done."},
        {"match": "SUBJOB-42", "completion": call("Bash", {"command": "echo sub > sub.txt", "description": "d"})},
        {
            "match": "TASK-DELEGATE",
            "completion": call(
                "Agent",
                {"description": "delegate", "prompt": "SUBJOB-42: create sub.txt", "subagent_type": "general-purpose"},
            ),
        },
        # Claude Code compaction: a tool round trip, `/compact`, then a follow-up
        {"match": "CRITICAL: Respond with TEXT ONLY", "completion": "Summary: notes.txt was created."},
        {"match": "SAY-BYE", "completion": "Bye."},
        {"match": r"TASK-COMPACT[\s\S]*<tool_response>", "completion": "Done."},
        {"match": "TASK-COMPACT", "completion": call("Bash", {"command": "echo n > notes.txt", "description": "d"})},
        # Codex: a free-form apply_patch edit (with reasoning, echoed back by the CLI)
        {"match": r"TASK-CX[\s\S]*<tool_response>", "completion": "Patched greet.txt."},
        {"match": "TASK-CX", "completion": call("apply_patch", {"input": PATCH}, think="Edit the greeting.")},
    ],
    "default": {"completion": "OK."},
}


def require_cli(name: str) -> str:
    try:
        binary = find_cli(name)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60).stdout
    assert VERSIONS[name] in out, f"{binary}: expected {VERSIONS[name]}, got {out!r}"
    return binary


class Stack:
    def __init__(self, ckpt: Path, log: Path, port: int, tmp: Path) -> None:
        self.ckpt, self.log, self.port, self.tmp = ckpt, log, port, tmp

    def args(self, **kw: Any) -> argparse.Namespace:
        base = dict(
            hf_checkpoint=str(self.ckpt),
            sglang_router_ip="127.0.0.1",
            sglang_router_port=self.port,
            rollout_max_response_len=256,
            rollout_max_context_len=32768,
            custom_rm_path=f"{__name__}.workspace_rm",
            agent_timeout=120.0,
            agent_cli_concurrency=4,
        )
        return default_args(**{**base, **kw})

    def engine_calls(self, sid: str) -> list[dict[str, Any]]:
        recs = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [r for r in recs if r["endpoint"] == "/generate" and str(r["body"]["rid"]).startswith(sid + "-")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from sim.tiny_checkpoint import build_tiny_checkpoint

    d = tmp_path_factory.mktemp("agent_cli")
    ckpt = build_tiny_checkpoint(d / "tiny", max_position_embeddings=65536)  # the CLIs' prompts fit
    (d / "script.json").write_text(json.dumps(SCRIPT))
    log = d / "engine.jsonl"
    args = ["--engine", "scripted", "--script", str(d / "script.json"), "--model-path", str(ckpt)]
    with launch_fake_sglang(args + ["--request-log", str(log)]) as eng:
        try:
            yield Stack(ckpt, log, int(eng.url.rsplit(":", 1)[1]), d)
        finally:
            run(stop_embedded_gateway())


def workspace_rm(args: Any, sample: Sample) -> float:
    """Reward = the expected file is on disk with the expected content (read before the workspace is removed)."""
    want = sample.metadata.get("expect_file")
    if not want:
        return 1.0
    path = Path(sample.metadata["agent_workdir"]) / want[0]
    return float(path.is_file() and path.read_text() == want[1])


def check_engine_tokens(samples: list[Sample], calls: list[dict[str, Any]]) -> None:
    """Every engine call is trained in exactly one sample (its output at mask 1 with its log-probs, right after
    its exact prompt), and nothing else is at mask 1. An earlier call may reappear as mask-0 context of a
    later segment (a rewritten history replays it)."""
    owner: dict[int, int] = {}
    for k, s in enumerate(samples):
        p = len(s.tokens) - s.response_length
        mask = [0] * p + list(s.loss_mask)
        lps = [0.0] * p + list(s.rollout_log_probs)
        expected: set[int] = set()
        for n, c in enumerate(calls):
            inp, out = c["body"]["input_ids"], c["responses"][0]["output_ids"]
            span = range(len(inp), len(inp) + len(out))
            if s.tokens[: len(inp)] != inp or s.tokens[span.start : span.stop] != out or not mask[span.start]:
                continue
            assert n not in owner, f"engine call {n} trained twice"
            owner[n] = k
            for j, t in enumerate(out):
                expected.add(span.start + j)
                assert lps[span.start + j] == pytest.approx(scripted_logprob(t, j))
        assert expected and {i for i, m in enumerate(mask) if m} == expected
    assert len(owner) == len(calls), f"engine calls {sorted(set(range(len(calls))) - set(owner))} are in no sample"


def episode(stack: Stack, gen, prompt: str, metadata: dict[str, Any] | None = None, **kw: Any) -> list[Sample]:
    sample = Sample(index=7, prompt=prompt, metadata=dict(metadata or {}))
    return run(gen(stack.args(**kw), sample, {"temperature": 1.0}))


def capture(stack: Stack, name: str, *, fixture: bool = False) -> Path | None:
    """The embedded gateway logs this episode's requests: a committed fixture is rewritten only with
    SLIME_RECAPTURE_FIXTURES=1; other captures go to a temporary file."""
    if not fixture:
        path = stack.tmp / f"{name}.jsonl"
    elif os.environ.get("SLIME_RECAPTURE_FIXTURES") == "1":
        path = FIXTURES / f"{name}.jsonl"
    else:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    run(get_embedded_gateway(stack.args())).request_log = str(path)
    return path


def stop_capture(stack: Stack) -> None:
    run(get_embedded_gateway(stack.args())).request_log = None


def test_claude_code_bash_and_write_episode(stack: Stack) -> None:
    require_cli("claude")
    path = capture(stack, "claude_code_tools")
    try:
        (s,) = episode(
            stack,
            claude_code.generate,
            "TASK-CC: write the notes",
            {"expect_file": ["notes/hello.txt", "hello from write\n"]},
        )
    finally:
        stop_capture(stack)
    assert s.status == Status.COMPLETED and s.reward == 1.0, s.metadata
    assert s.metadata["num_tool_calls"] == 2 and s.metadata["final_answer"] == "All done: notes written."
    assert s.metadata["agent_exit_code"] == 0 and s.metadata["agent_error"] is None
    assert s.metadata["segment_kind"] == "final" and s.metadata["num_turns"] == 3
    calls = stack.engine_calls(s.metadata["agent_session_id"])
    assert len(calls) == 3
    check_engine_tokens([s], calls)
    assert not Path(s.metadata["agent_workdir"]).exists()  # the workspace is gone
    # always streamed; the thinking block came back with our signature, before the tool_use
    reqs = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(reqs) == 3 and all(r["body"]["stream"] is True for r in reqs)
    assert all(r["headers"].get("User-Agent", "").startswith("claude-cli/2.1.197") for r in reqs)
    first_answer = reqs[1]["body"]["messages"][1]["content"]
    assert first_answer[0] == {
        "type": "thinking",
        "thinking": "Make the directory first.",
        "signature": f"slime:{calls[0]['body']['rid']}",
    }
    assert first_answer[1]["type"] == "tool_use" and first_answer[1]["name"] == "Bash"


def test_timeout_kills_the_cli_and_its_tools(stack: Stack) -> None:
    import psutil

    require_cli("claude")
    (s,) = episode(stack, claude_code.generate, "TASK-HANG: wait", agent_timeout=4.0)
    assert s.metadata["agent_timed_out"] is True and s.status == Status.TRUNCATED
    assert s.metadata["agent_error"] == "timed out after 4s"
    assert s.metadata["num_tool_calls"] >= 1 and sum(s.loss_mask) > 0  # what was sampled is kept
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if "30.432" in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, [p.info["cmdline"] for p in leftovers]
    assert not Path(s.metadata["agent_workdir"]).exists()


def test_claude_code_subagent_episode(stack: Stack) -> None:
    require_cli("claude")
    path = capture(stack, "claude_code_subagent", fixture=True)
    try:
        out = episode(stack, claude_code.generate, "TASK-DELEGATE: please delegate", agent_tools="Bash,Write,Agent")
    finally:
        stop_capture(stack)
    kinds = [s.metadata["segment_kind"] for s in out]
    assert sorted(kinds) == ["final", "subagent"], kinds  # one main segment, one sub-agent segment, no wipe
    main = next(s for s in out if s.metadata["segment_kind"] == "final")
    sub = next(s for s in out if s.metadata["segment_kind"] == "subagent")
    assert main.metadata["num_turns"] == 2 and sub.metadata["num_turns"] == 2
    assert len({s.group_id for s in out}) == 1 and all(s.status == Status.COMPLETED for s in out)
    assert all(s.metadata["num_segments"] == 2 for s in out)
    calls = stack.engine_calls(main.metadata["agent_session_id"])
    assert len(calls) == 4
    check_engine_tokens(out, calls)
    if path is not None:
        assert len(path.read_text().splitlines()) == 4


def test_claude_code_compaction_yields_wipe(stack: Stack) -> None:
    require_cli("claude")
    path = capture(stack, "claude_code_compact", fixture=True)
    try:
        out = episode(
            stack, claude_code.generate, "TASK-COMPACT: make notes", {"agent_follow_ups": ["/compact", "SAY-BYE now"]}
        )
    finally:
        stop_capture(stack)
    kinds = [s.metadata["segment_kind"] for s in out]
    assert kinds.count("wipe") >= 1 and kinds[-1] == "final", kinds
    assert len({s.group_id for s in out}) == 1
    assert out[-1].metadata["final_answer"] == "Bye."
    check_engine_tokens(out, stack.engine_calls(out[0].metadata["agent_session_id"]))
    if path is not None:
        assert len(path.read_text().splitlines()) >= 4


def test_codex_apply_patch_episode(stack: Stack) -> None:
    require_cli("codex")
    meta = {"files": {"greet.txt": "hello\n"}, "expect_file": ["greet.txt", "hello world\n"]}
    path = capture(stack, "codex_apply_patch")
    try:
        (s,) = episode(stack, codex.generate, "TASK-CX: change the greeting", meta)
    finally:
        stop_capture(stack)
    assert s.status == Status.COMPLETED and s.reward == 1.0, s.metadata  # the patch changed the file on disk
    assert s.metadata["num_tool_calls"] == 1 and s.metadata["final_answer"] == "Patched greet.txt."
    calls = stack.engine_calls(s.metadata["agent_session_id"])
    assert len(calls) == 2
    check_engine_tokens([s], calls)
    # Responses API only, always streaming; our reasoning item came back verbatim, the edit as a custom tool call
    reqs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["path"].rsplit("/", 1)[1] for r in reqs] == ["responses", "responses"]
    assert all(r["body"]["stream"] is True for r in reqs)
    items = reqs[1]["body"]["input"]
    rid = calls[0]["body"]["rid"]
    reasoning = [it for it in items if it.get("type") == "reasoning"]
    assert reasoning and reasoning[0]["encrypted_content"] == f"slime:{rid}"
    (patch,) = [it for it in items if it.get("type") == "custom_tool_call"]
    assert patch["name"] == "apply_patch" and patch["input"] == PATCH
    assert any(it.get("type") == "custom_tool_call_output" and it["call_id"] == patch["call_id"] for it in items)


# ---- replays of the committed captures (no CLI needed) ------------------------------------------------

_OUR_TOOL_ID = re.compile(r"toolu_sess-[0-9a-f]{16}-[0-9a-f]{4}(\d+)_(\d+)")


def replay(stack: Stack, name: str) -> tuple[Gateway, str, list[Any]]:
    """POST every captured request to a fresh gateway session, in order. Tool-use ids in the capture were
    minted by the capturing gateway; they are mapped to this gateway's ids in generation order (the id's
    counter), so tool results still name the calls this gateway made."""
    from transformers import AutoTokenizer

    lines = (FIXTURES / f"{name}.jsonl").read_text().splitlines()
    found = sorted(_OUR_TOOL_ID.finditer("\n".join(lines)), key=lambda m: (int(m[1]), int(m[2])))
    old = list(dict.fromkeys(m.group(0) for m in found))
    gw = Gateway(AutoTokenizer.from_pretrained(stack.ckpt), f"http://127.0.0.1:{stack.port}")
    url = run(gw.start())
    sess = run(gw.open_session({"temperature": 1.0}, 32768))
    new: list[str] = []
    with httpx.Client(timeout=60) as c:
        for line in lines:
            for o, n in zip(old, new, strict=False):
                line = line.replace(o, n)
            rec = json.loads(line)
            assert rec["body"]["stream"] is True  # Claude Code always streams
            r = c.post(f"{url}/v1/messages", json=rec["body"], headers={"x-api-key": sess["api_key"]})
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for ev in r.text.split("\n\n"):
                data = ev.partition("data: ")[2]
                if '"content_block_start"' in data and '"tool_use"' in data:
                    new.append(json.loads(data)["content_block"]["id"])
    return gw, sess["session_id"], new


def test_replayed_subagent_capture_freezes_the_subagent_on_its_tool_result(stack: Stack) -> None:
    gw, sid, new_ids = replay(stack, "claude_code_subagent")
    try:
        agent_id = new_ids[0]
        state = run(gw.store.get(sid))
        assert state.frozen and state.frozen[0][:2] == ("subagent", f"sub:{agent_id.removeprefix('toolu_')}")
        segs = run(gw.finish_session(sid))
        assert [g.metadata["segment_kind"] for g in segs] == ["subagent", "final"]
        assert [g.metadata["num_turns"] for g in segs] == [2, 2] and all(g.metadata["num_drifts"] == 0 for g in segs)
        assert all(sum(g.loss_mask) > 0 for g in segs)
    finally:
        run(gw.stop())


def test_replayed_compaction_capture_yields_wipe_segments(stack: Stack) -> None:
    gw, sid, _ = replay(stack, "claude_code_compact")
    try:
        segs = run(gw.finish_session(sid))
        # pre-compaction context (tool round trip), the summary request, the continued conversation
        assert [g.metadata["segment_kind"] for g in segs] == ["wipe", "wipe", "final"]
        assert [g.metadata["num_turns"] for g in segs] == [2, 1, 1]
        assert all(sum(g.loss_mask) > 0 and g.metadata["num_drifts"] == 0 for g in segs)
    finally:
        run(gw.stop())
