"""Repository-task episodes (slime/agent/harness/repo_task.py) with real Claude Code in `local` sandboxes,
driven by the coding-agent example's scripted policy behind a `scripted` fake engine, without Ray.

A test-editing patch scores 0 (the scorer does not apply its change to the tests) while the known-good one scores 1; a
harness over its budget is killed (with the tool it left running) and yields an ABORTED placeholder whose
reason says so; the session is finished either way and no sandbox process or directory outlives the episode.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from examples.coding_agent.scripted_policy import build_script
from sim.fake_sglang.testing import launch_fake_sglang
from sim.process_tree import sandbox_processes
from slime.agent.embedded import get_embedded_gateway, stop_embedded_gateway
from slime.agent.harness import repo_task
from slime.arguments import default_args
from slime.utils.async_utils import run
from slime.utils.types import Sample, Status

pytestmark = pytest.mark.cpu

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_agent_cli_harnesses import require_cli  # noqa: E402

TASKS = Path(__file__).resolve().parents[2] / "examples" / "coding_agent" / "tasks.jsonl"
ROWS = {json.loads(x)["metadata"]["instance_id"]: json.loads(x) for x in TASKS.read_text().splitlines()}
HANG = "<tool_call>\n" + json.dumps(
    {"name": "Bash", "arguments": {"command": "(setsid sleep 919.25 &); sleep 920.25"}}
)
HANG += "\n</tool_call>"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int, Path]]:
    from sim.tiny_checkpoint import build_tiny_checkpoint

    d = tmp_path_factory.mktemp("coding_episode")
    ckpt = build_tiny_checkpoint(d / "tiny", max_position_embeddings=65536)  # the CLIs' prompts fit
    script = build_script("claude-code", [{"match": "HANG-NOW", "completion": HANG}])
    (d / "script.json").write_text(json.dumps(script))
    with launch_fake_sglang(
        ["--engine", "scripted", "--script", str(d / "script.json"), "--model-path", str(ckpt)]
    ) as e:
        try:
            yield ckpt, int(e.url.rsplit(":", 1)[1]), d
        finally:
            run(stop_embedded_gateway())


def args_for(engine: tuple[Path, int, Path], **kw: Any) -> Any:
    ckpt, port, d = engine
    base = dict(
        hf_checkpoint=str(ckpt),
        sglang_router_ip="127.0.0.1",
        sglang_router_port=port,
        rollout_max_response_len=512,
        rollout_max_context_len=32768,
        agent_harness="claude-code",
        agent_timeout=120.0,
        agent_sandbox_dir=str(d / "sandboxes"),
        prompt_data=str(TASKS),
    )
    return default_args(**{**base, **kw})


def episode(args: Any, iid: str, prompt_suffix: str = "") -> list[Sample]:
    row = ROWS[iid]
    sample = Sample(index=3, prompt=row["input"] + prompt_suffix, metadata=dict(row["metadata"]))
    return run(repo_task.generate(args, sample, {"temperature": 1.0}))


def leftovers(root: Path, needle: str) -> list[str]:
    """This test's sandbox processes (not the other worker's), and any live process whose cmdline has `needle`."""
    named = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline", "status"])
             if p.info["status"] != psutil.STATUS_ZOMBIE and needle in " ".join(p.info["cmdline"] or [])]  # fmt: skip
    return sandbox_processes(root) + named


def session_was_finished(args: Any, sid: str) -> bool:
    async def state() -> bool:
        gw = await get_embedded_gateway(args)
        return (await gw.store.get(sid)).sealed

    return run(state())


def test_good_patch_scores_one_and_test_editing_patch_zero(engine) -> None:
    require_cli("claude")
    args = args_for(engine)
    (good,) = episode(args, "stack-peek")
    (cheat,) = episode(args, "palindrome-case")  # the scripted policy guts the failing test
    for s in (good, cheat):
        assert s.status == Status.COMPLETED and s.metadata["num_tool_calls"] == 1, s.metadata
        assert s.metadata["apply_method"] == "3way" and s.metadata["applied_cleanly"] is True
        assert sum(s.loss_mask) > 0 and s.metadata["segment_kind"] == "final"
        assert session_was_finished(args, s.metadata["agent_session_id"])
    assert good.reward == 1.0 and good.metadata["tests_failed"] == []
    assert cheat.reward == 0.0
    assert cheat.metadata["tests_failed"] == ["tests.test_palindrome.TestPalindrome.test_sentence"]
    assert not list((engine[2] / "sandboxes").glob("slime-sbx-*"))


def test_harness_over_budget_is_killed_and_aborted(engine) -> None:
    require_cli("claude")
    args = args_for(engine, agent_timeout=6.0)
    (s,) = episode(args, "clamp-high", "\nHANG-NOW")
    assert s.status == Status.ABORTED and s.metadata["agent_timed_out"] is True
    assert "over its budget" in s.metadata["abort_reason"]
    assert s.loss_mask == [0] and s.reward == 0.0 and s.response_length == 1
    assert session_was_finished(args, s.metadata["agent_session_id"])
    sandboxes = engine[2] / "sandboxes"
    assert leftovers(sandboxes, "919.25") == [] and leftovers(sandboxes, "920.25") == []
    assert not list((engine[2] / "sandboxes").glob("slime-sbx-*"))
