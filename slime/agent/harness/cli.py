"""Shared machinery of the CLI harnesses (`claude-code`, `codex`): one real agent CLI per sample.

Why real CLIs: the policy is trained on exactly the requests the production agent sends (prompts, tool
schemas, retries, sub-agents, compaction), not on an imitation. Each episode runs the CLI as a subprocess in a
fresh temporary working directory and HOME, pointed at its own gateway session (per-session credential and
base URL), with a wall-clock budget (`--agent-timeout`); on timeout or cancellation the CLI's whole process
group is killed (the tools it started included). The reward is computed while the workspace still exists
(`metadata["agent_workdir"]`), so a reward function can run tests on what the agent wrote; then the
workspace is deleted and the gateway's token segments become the trajectory's samples (one group id).

Where the CLIs come from: `ci/agent_clis.sh` installs the pinned npm packages into a prefix
(`--agent-cli-prefix`, else `$SLIME_AGENT_CLIS_PREFIX`, else `.agent-clis/` at the repository root);
`$SLIME_CLAUDE_BIN` / `$SLIME_CODEX_BIN` point at a binary directly; `claude` / `codex` on PATH come last.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import os
import shlex
import shutil
import tempfile
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime.agent.embedded import get_embedded_gateway
from slime.agent.episode_process import EPISODE_MARKER, CliRun, run_cli
from slime.agent.gateway import Gateway
from slime.agent.session import AUX_KIND
from slime.agent.trajectory import TokenSegment, fan_out_sample_segments
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_PREFIX = REPO_ROOT / ".agent-clis"
# where the npm packages (installed by ci/agent_clis.sh) put their native binaries, any Linux arch
CLI_BINARIES = {
    "claude": ("SLIME_CLAUDE_BIN", "node_modules/@anthropic-ai/claude-code-linux-*/claude"),
    "codex": ("SLIME_CODEX_BIN", "node_modules/@openai/codex-linux-*/vendor/*-unknown-linux-musl/bin/codex"),
}

_limits: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def find_cli(name: str, prefix: str | None = None) -> str:
    env_var, pattern = CLI_BINARIES[name]
    if os.environ.get(env_var):
        return os.environ[env_var]
    prefixes = [prefix, os.environ.get("SLIME_AGENT_CLIS_PREFIX"), str(DEFAULT_PREFIX)]
    for p in prefixes:
        hits = sorted(Path(p).glob(pattern)) if p else []
        if hits:
            return str(hits[0])
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(
        f"{name} CLI not found (looked at ${env_var}, {', '.join(str(p) for p in prefixes if p)}, PATH): "
        "run ci/agent_clis.sh"
    )


@dataclass
class Episode:
    """What one harness run produced, besides the gateway's token segments."""

    final_text: str = ""
    num_tool_calls: int = 0
    error: str | None = None  # the CLI reported failure (API error, crash)
    timed_out: bool = False
    returncode: int | None = None
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Workspace:
    """Where a CLI episode runs: a temporary directory on this machine. A sandbox (`slime/agent/sandbox.py`)
    offers the same four members, so the runners below work in either."""

    root: Path
    workdir: Path
    home: Path

    async def exec(self, cmd: list[str], env: dict[str, str], timeout_s: float) -> CliRun:
        return await run_cli(cmd, cwd=str(self.workdir), env=env, timeout_s=timeout_s)

    async def write_file(self, path: str | Path, data: str | bytes) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data.encode() if isinstance(data, str) else data)

    @classmethod
    def create(cls, sample: Sample) -> Workspace:
        root = Path(tempfile.mkdtemp(prefix="slime-agent-"))
        ws = cls(root, root / "work", root / "home")
        try:
            ws.workdir.mkdir()
            ws.home.mkdir()
            files = sample.metadata.get("files")
            if isinstance(files, dict):  # seed the task's files (relative paths only)
                for rel, content in files.items():
                    path = (ws.workdir / rel).resolve()
                    if not path.is_relative_to(ws.workdir.resolve()):
                        raise ValueError(f"metadata.files: {rel!r} leaves the working directory")
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(str(content))
        except BaseException:
            ws.remove()
            raise
        return ws

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def base_env(ws: Workspace) -> dict[str, str]:
    """A clean environment: nothing of the trainer's (keys, proxies) leaks into the agent."""
    env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "HOME": str(ws.home)}
    env["LANG"] = os.environ.get("LANG", "C.UTF-8")
    env["TMPDIR"] = str(ws.root)
    env[EPISODE_MARKER] = ws.root.name  # unique per episode: finds the agent's processes at the end
    return env


def extra_cli_args(args: Any) -> list[str]:
    return shlex.split(args.agent_cli_args or "")


def task_prompt(sample: Sample) -> str:
    if isinstance(sample.prompt, str):
        return sample.prompt
    users = [m.get("content") for m in sample.prompt if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1], str):
        raise ValueError(f"sample {sample.index}: a CLI harness needs a text prompt")
    return users[-1]


def parse_jsonl(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def trainable(segments: list[TokenSegment]) -> tuple[list[TokenSegment], int]:
    """Auxiliary (small/fast model) segments are recorded by the gateway but never become samples."""
    keep = [s for s in segments if s.metadata.get("segment_kind") != AUX_KIND]
    return keep, len(segments) - len(keep)


def concurrency_limit(args: Any) -> asyncio.Semaphore:
    """The running loop's bound on CLI episodes at once (`--agent-cli-concurrency`)."""
    return _limits.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(args.agent_cli_concurrency))


Runner = Callable[[Any, Gateway, dict[str, str], Sample, Workspace, float], Awaitable[Episode]]


async def run_episode(args: Any, sample: Sample, sampling_params: dict[str, Any], runner: Runner) -> list[Sample]:
    """Open a session, run the harness-specific `runner` in a fresh workspace, score, fan out."""
    from slime.rollout.generate import GenerateState
    from slime.rollout.rm_hub import async_rm

    gw = await get_embedded_gateway(args)
    limit = concurrency_limit(args)
    timeout_s = float(args.agent_timeout)
    async with limit:
        ws = Workspace.create(sample)
        ep = Episode(error="not started")
        try:
            sess = await gw.open_session(
                sampling_defaults=sampling_params,
                max_context_tokens=args.rollout_max_context_len or 0,  # None: no cap
                metadata={"index": sample.index},
            )
            try:
                ep = await runner(args, gw, sess, sample, ws, timeout_s)
            finally:
                segments = await gw.finish_session(sess["session_id"])
            if ep.error:  # a CLI's error may quote its base URL, which holds the session key
                ep.error = ep.error.replace(sess["api_key"], "***")
            segments, num_aux = trainable(segments)
            meta = {
                "num_tool_calls": ep.num_tool_calls,
                "final_answer": ep.final_text,
                "agent_exit_code": ep.returncode,
                "agent_timed_out": ep.timed_out,
                "agent_error": ep.error,
                "agent_seconds": round(ep.seconds, 3),
                "num_auxiliary_segments": num_aux,
                "agent_session_id": sess["session_id"],
                "agent_workdir": str(ws.workdir),  # removed after scoring
                **ep.extra,
            }
            if GenerateState.get(args).aborted:  # the rollout stopped the engines: the episode cannot resume
                sample.status = Status.ABORTED
                sample.metadata.update(meta, abort_reason="rollout aborted")
                return [sample]
            if not segments:
                sample.status = Status.ABORTED
                sample.metadata.update(meta, abort_reason=ep.error or "the agent produced no tokens")
                return [sample]
            scored = copy.copy(sample)
            scored.response = ep.final_text
            scored.metadata = {**sample.metadata, **meta}
            reward = await async_rm(args, scored)
        finally:
            ws.remove()
    out = fan_out_sample_segments(
        sample,
        segments,
        reward,
        mode=args.fan_out_reward,
        tokenizer=gw.tokenizer,
        metadata=meta,
    )
    cut = ep.timed_out or segments[-1].metadata.get("finish_reason") == "length"
    for s in out:
        s.status = Status.TRUNCATED if cut else Status.COMPLETED
    return out
