"""How one command of an agent episode runs on this machine, and how it is stopped with everything it started.

Used by the CLI harnesses (a CLI in a temporary workspace) and by the `local` sandbox (every command it runs).
The command gets its own process group (`slime.utils.process.die_with_parent`); at exit, timeout or
cancellation the group is SIGTERMed, SIGKILLed after a grace period, and then two sweeps take what left the
group: every process whose environment still carries the episode's marker (tools that `setsid`-ed away), and,
when the caller passes one, every process of the sandbox's own uid (the marker can be scrubbed, the uid can't).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from slime.utils.process import die_with_parent, stop_async, wait_exited

logger = logging.getLogger(__name__)

KILL_GRACE_S = 3.0
EPISODE_MARKER = "SLIME_AGENT_EPISODE"


@dataclass
class CliRun:
    """What one command did: exit code (None if it never exited), output, and whether its time ran out."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float


def reap_marked(marker: str) -> int:
    """Kill every process carrying this episode's marker in its environment: tools that left the CLI's
    process group (setsid, daemonised servers) still inherit the environment."""
    import psutil

    n = 0
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.pid != os.getpid() and p.environ().get(EPISODE_MARKER) == marker:
                p.kill()
                n += 1
    return n


def reap_uid(uid: int) -> int:
    """Kill every process running as `uid` (a sandbox's own uid: nothing else runs as it)."""
    import psutil

    if uid == os.getuid():  # never sweep our own user (a fallback sandbox runs as us)
        return 0
    n = 0
    for p in psutil.process_iter(["uids"]):
        with contextlib.suppress(psutil.Error):
            if p.info["uids"] is not None and uid in (p.info["uids"].real, p.info["uids"].effective):
                p.kill()
                n += 1
    return n


async def _stop(proc: asyncio.subprocess.Process, marker: str | None, sweep: Callable[[], int] | None) -> None:
    await stop_async(proc, KILL_GRACE_S)
    n = reap_marked(marker) if marker else 0
    n += sweep() if sweep else 0
    if n:
        logger.info("killed %d leftover process(es) of agent episode %s", n, marker)


async def _pump(stream: asyncio.StreamReader, buf: bytearray) -> None:
    while chunk := await stream.read(1 << 16):
        buf += chunk


async def run_cli(
    cmd: list[str],
    *,
    cwd: str,
    env: dict[str, str],
    timeout_s: float,
    sweep: Callable[[], int] | None = None,
    stdin: bytes | None = None,
) -> CliRun:
    """Run one command in its own process group; kill the group (every process that inherited
    `env[EPISODE_MARKER]`, and whatever `sweep` finds) when it exits, times out or is cancelled.
    Output read before a timeout is kept."""
    marker = env.get(EPISODE_MARKER)
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=die_with_parent,  # own process group; dies with the rollout process
    )
    out, err = bytearray(), bytearray()
    assert proc.stdout is not None and proc.stderr is not None
    readers = [asyncio.create_task(_pump(proc.stdout, out)), asyncio.create_task(_pump(proc.stderr, err))]
    if stdin is not None:
        assert proc.stdin is not None
        with contextlib.suppress(OSError):
            proc.stdin.write(stdin)
            await proc.stdin.drain()
            proc.stdin.close()
    try:
        timed_out = not await wait_exited(proc, timeout_s)
    except BaseException:
        await asyncio.shield(_stop(proc, marker, sweep))
        for r in readers:
            r.cancel()
        raise
    await _stop(proc, marker, sweep)
    _, pending = await asyncio.wait(readers, timeout=5.0)  # the pipes close once every holder is gone
    for r in pending:
        r.cancel()
    return CliRun(
        proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"), timed_out, time.monotonic() - t0
    )
