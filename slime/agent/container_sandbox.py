"""`--agent-sandbox container`: the `local` sandbox's files and lifecycle, with every command run in a fresh
container of the task image (`--agent-sandbox-image`, built from examples/coding_agent/Dockerfile) through
the docker or podman CLI (`--agent-sandbox-runtime`, else whichever is on PATH).

Each `exec` is one `RUNTIME run --rm` with: no network (`--network none`: loopback only; when the episode
needs the gateway, `sandbox_init.py` inside the container relays 127.0.0.1:<port> to the sandbox's Unix
socket, exactly as the local sandbox does), the sandbox's uid, memory and process limits, the sandbox
directory bind-mounted at its own path (so paths are the same inside and out), the command's binary
directory and `sandbox_init.py` mounted read-only. Environment values travel as `-e NAME` (taken from the
CLI's environment), never on the command line, so a session key never shows in `ps`. On timeout or
cancellation the container is removed (`RUNTIME rm -f`), not just the CLI process.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

from slime.agent.episode_process import CliRun, run_cli
from slime.agent.local_sandbox import INIT, LocalSandbox

INIT_IN_CONTAINER = "/opt/slime/sandbox_init.py"


def find_runtime(name: str | None) -> str:
    for cand in [name] if name else ["docker", "podman"]:
        path = shutil.which(cand)
        if path:
            return path
    raise FileNotFoundError(f"--agent-sandbox container: no {name or 'docker or podman'} on PATH")


class ContainerSandbox(LocalSandbox):
    def __init__(self, task_dir: Path, gateway: tuple[str, int] | None = None, *, image: str, runtime: str, **kw: Any):
        super().__init__(task_dir, gateway, **kw)
        self.image, self.runtime = image, runtime

    @classmethod
    def from_args(cls, args: Any, task_dir: Path, gateway: tuple[str, int] | None) -> ContainerSandbox:
        return cls(
            task_dir,
            gateway,
            image=args.agent_sandbox_image,
            runtime=find_runtime(args.agent_sandbox_runtime),
            memory_mb=args.agent_sandbox_memory_mb,
            cpu_seconds=args.agent_sandbox_cpu_seconds or int(max(args.agent_timeout, args.agent_eval_timeout)),
            base_dir=args.agent_sandbox_dir,
        )

    def _create(self) -> None:
        super()._create()
        self.mode = "container"  # the container, not this host's namespaces, isolates the command

    def _relay_wanted(self) -> bool:
        return bool(self.gateway)

    def spec(self, cwd: Path | None = None) -> dict[str, Any]:
        spec = super().spec(cwd)
        spec.update(isolate=False, uid=None, gid=None)  # `--user` and `--network none` do that part
        if self.gateway:
            spec["relay"] = {"port": self.gateway[1], "socket": str(self.root / "gw.sock")}
        return spec

    def container_command(self, cmd: list[str], env: dict[str, str], name: str) -> list[str]:
        uid = self.uid if self.uid is not None else os.getuid()
        run = [self.runtime, "run", "--rm", "-i", "--name", name, "--network", "none", "--user", f"{uid}:{uid}"]
        run += ["--pids-limit", str(self.max_processes), "--workdir", str(self.workdir)]
        if self.memory_mb:
            run += ["--memory", f"{self.memory_mb}m"]
        run += ["-v", f"{self.root}:{self.root}", "-v", f"{INIT}:{INIT_IN_CONTAINER}:ro"]
        binary = Path(cmd[0])
        if binary.is_absolute() and binary.exists() and not binary.is_relative_to(self.root):
            run += ["-v", f"{binary.parent}:{binary.parent}:ro"]  # the agent CLI lives on the host
        for key in sorted(env):
            if key != "PATH":  # the image's PATH, not the host's
                run += ["-e", key]
        return run + [self.image, "python3", "-I", "-S", INIT_IN_CONTAINER, json.dumps(self.spec()), "--", *cmd]

    async def exec(
        self, cmd: list[str], env: dict[str, str], timeout_s: float, *, stdin: bytes | None = None
    ) -> CliRun:
        env = {**env, "HOME": env.get("HOME", str(self.home)), "TMPDIR": str(self.tmp)}
        name = f"slime-sbx-{secrets.token_hex(6)}"

        def remove() -> int:
            subprocess.run([self.runtime, "rm", "-f", name], capture_output=True, timeout=60)
            return 0

        host_env = {**env, "PATH": os.environ.get("PATH", "/usr/bin:/bin")}  # PATH of the runtime CLI
        return await run_cli(
            self.container_command(cmd, env, name),
            cwd=str(self.root),
            env=host_env,
            timeout_s=timeout_s,
            sweep=remove,
            stdin=stdin,
        )
