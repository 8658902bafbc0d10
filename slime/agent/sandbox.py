"""Sandboxes: where an agent episode edits a task repository and where its patch is scored.

`--agent-sandbox` picks the implementation:

* `local` (default): a fresh copy of the task repository per sandbox on this machine
  (`slime/agent/local_sandbox.py`); each command runs as the sandbox's own unprivileged uid, in private mount
  and network namespaces, with CPU, memory, process and wall-clock limits, and everything it started is killed
  when it ends. Where the host cannot give namespaces or a uid (not root), it degrades and says so in the log;
  docs/agent.md ("Sandboxes") states what each mode isolates.
* `container`: the same over the docker or podman CLI, one container per command on a task image
  (`slime/agent/container_sandbox.py`).
* an import path `package.module.factory`: the adapter point for remote sandboxes (E2B-style services).
  `factory(args, task_dir, gateway)` returns an object with the members of `Sandbox` below; `gateway` is the
  `(host, port)` the agent must reach (a remote sandbox needs a routable `--agent-gateway-host`). slime adds
  no dependency for it: the adapter brings its own client.

A sandbox is used as `async with make_sandbox(args, task_dir, gateway) as sb:`; leaving the block kills every
process of the sandbox and deletes its files.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

from slime.agent.episode_process import CliRun
from slime.agent.local_sandbox import HARNESS_FILES, LocalSandbox

SANDBOX_KINDS = ("local", "container")


@runtime_checkable
class Sandbox(Protocol):
    """One isolated copy of a task repository. Paths are absolute, as commands inside the sandbox see them."""

    root: Path  # the sandbox's own directory; nothing the agent writes lands outside it
    workdir: Path  # the task repository (a git checkout whose HEAD is the task as given)
    home: Path  # HOME of the commands (harness configuration lives here, outside the repository)

    async def __aenter__(self) -> Sandbox: ...

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    async def exec(
        self, cmd: list[str], env: dict[str, str], timeout_s: float, *, stdin: bytes | None = None
    ) -> CliRun:
        """Run `cmd` in `workdir`; on exit, timeout or cancellation every process it started is killed."""
        ...

    async def write_file(self, path: str | Path, data: str | bytes) -> None: ...

    async def read_file(self, path: str | Path) -> str: ...

    async def export_diff(self, exclude: tuple[str, ...] = HARNESS_FILES) -> str:
        """The agent's changes to the repository as a git patch (new files included, `exclude` left out)."""
        ...


def make_sandbox(args: Any, task_dir: str | Path, gateway: tuple[str, int] | None) -> Sandbox:
    """The sandbox `--agent-sandbox` names, for one copy of `task_dir`; `gateway` = what the agent may reach
    (None: no network at all, as when scoring)."""
    kind = args.agent_sandbox
    if kind == "local":
        return LocalSandbox.from_args(args, Path(task_dir), gateway)
    if kind == "container":
        from slime.agent.container_sandbox import ContainerSandbox

        return ContainerSandbox.from_args(args, Path(task_dir), gateway)
    from slime.utils.misc import load_function

    return load_function(kind)(args, Path(task_dir), gateway)
