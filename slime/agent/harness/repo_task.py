"""Repository-task episodes (the coding-agent example, examples/coding_agent/): a real agent CLI fixes an issue
in a sandboxed copy of a task repository, and its patch is scored in a fresh copy.

`--custom-generate-function-path slime.agent.harness.repo_task.generate` with `--agent-harness claude-code`
(or `codex`) picks the CLI. One episode:

1. boot a sandbox (`--agent-sandbox`) from the task's repository and write the issue to `ISSUE.md`;
2. run the harness inside it against the sample's gateway session (base URL and key) within
   `--agent-timeout` seconds of wall clock (a turn budget goes through the CLI's own flag, e.g.
   `--agent-cli-args "--max-turns 30"` for Claude Code);
3. export the agent's changes as a git patch (harness files left out) and close that sandbox: every
   process of it is killed, its files deleted;
4. score the patch in a **fresh** sandbox of the same task (no network): applied without its changes to the
   test tree and harness files, tests run by slime's own runner, reward 1 iff every fail-to-pass and
   pass-to-pass test passes (`slime/agent/harness/scoring.py` says how each way around the tests is closed);
5. finish the gateway session and fan its segments out into samples sharing one group id.

Any failure (boot, harness over its budget, export, scoring) yields one ABORTED placeholder sample whose
`metadata["abort_reason"]` says why; the session is always finished and both sandboxes always closed.

A task is the sample's metadata (`slime.agent.harness.scoring.RepoTask`). The prompt is the sample's prompt (the
issue text and what to do).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any
from urllib.parse import urlsplit

from slime.agent.embedded import get_embedded_gateway
from slime.agent.harness.claude_code import run_claude
from slime.agent.harness.cli import Episode, concurrency_limit, trainable
from slime.agent.harness.codex import run_codex
from slime.agent.harness.scoring import RepoTask, score_patch
from slime.agent.sandbox import make_sandbox
from slime.agent.trajectory import fan_out_sample_segments
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)

RUNNERS = {"claude-code": run_claude, "codex": run_codex}


def aborted_sample(sample: Sample, reason: str, meta: dict[str, Any]) -> Sample:
    """A placeholder that trains nothing (one response token at mask 0) and says why the episode failed."""
    sample.tokens, sample.response_length, sample.loss_mask = [0, 0], 1, [0]
    sample.rollout_log_probs, sample.response, sample.reward = [0.0], "", 0.0
    sample.status = Status.ABORTED
    sample.metadata = {**sample.metadata, **meta, "abort_reason": reason}
    return sample


def _gateway_address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    return ("127.0.0.1" if host in ("0.0.0.0", "::") else host), int(parts.port or 80)


async def generate(
    args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Sample]:
    from slime.rollout.generate import GenerateState

    runner = RUNNERS.get(args.agent_harness or "claude-code")
    if runner is None:
        return [aborted_sample(sample, f"--agent-harness {args.agent_harness}: not a CLI harness", {})]
    gw = await get_embedded_gateway(args)
    meta: dict[str, Any] = {"instance_id": sample.metadata.get("instance_id")}
    t0 = time.monotonic()
    async with concurrency_limit(args):
        sess = await gw.open_session(
            sampling_defaults=sampling_params,
            max_context_tokens=args.rollout_max_context_len or 0,
            metadata={"index": sample.index, "instance_id": meta["instance_id"]},
        )
        meta["agent_session_id"] = sess["session_id"]
        segments: list = []
        ep = Episode(error="not started")
        try:
            task = RepoTask.from_sample(args, sample)
            async with make_sandbox(args, task.repo, _gateway_address(gw.public_url or "")) as sb:
                meta["boot_seconds"] = round(time.monotonic() - t0, 3)
                await sb.write_file(sb.workdir / "ISSUE.md", str(sample.prompt))
                ep = await runner(args, gw, sess, sample, sb, float(args.agent_timeout))
                meta.update(agent_seconds=round(ep.seconds, 3), num_tool_calls=ep.num_tool_calls)
                meta.update(agent_exit_code=ep.returncode, agent_timed_out=ep.timed_out, **ep.extra)
                if ep.timed_out:
                    raise TimeoutError(f"the harness ran over its budget ({args.agent_timeout:g}s) and was killed")
                patch = await sb.export_diff()
            meta["patch_bytes"] = len(patch.encode())
            score = await score_patch(args, task, patch)
            meta.update(score)
        except Exception as e:
            reason = str(e).replace(sess["api_key"], "***") or type(e).__name__
            logger.warning("episode %s aborted: %s", meta["instance_id"], reason)
            return [aborted_sample(sample, reason, {**meta, "elapsed_seconds": round(time.monotonic() - t0, 3)})]
        finally:
            segments = await asyncio.shield(gw.finish_session(sess["session_id"]))
    meta["elapsed_seconds"] = round(time.monotonic() - t0, 3)
    if ep.error:
        meta["agent_error"] = ep.error.replace(sess["api_key"], "***")
    segments, meta["num_auxiliary_segments"] = trainable(segments)
    meta["num_turns_total"] = sum(int(s.metadata.get("num_turns", 0)) for s in segments)
    if GenerateState.get(args).aborted:
        return [aborted_sample(sample, "rollout aborted", meta)]
    if not segments:
        return [aborted_sample(sample, ep.error or "the agent produced no tokens", meta)]
    out = fan_out_sample_segments(
        sample, segments, meta["reward"], mode=args.fan_out_reward, tokenizer=gw.tokenizer, metadata=meta
    )
    cut = segments[-1].metadata.get("finish_reason") == "length"
    for s in out:
        s.status = Status.TRUNCATED if cut else Status.COMPLETED
    return out


generate.drives_agent_harness = True  # type: ignore[attr-defined] - `--agent-harness` picks the CLI it runs
