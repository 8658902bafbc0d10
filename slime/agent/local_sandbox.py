"""`--agent-sandbox local`: a fresh copy of the task repository per sandbox, on this machine.

Layout of one sandbox (`<base>/slime-sbx-XXXX/`, root-owned, mode 0711):
`work/` the repository (a git checkout whose one commit is the task as given), `home/` HOME, `tmp/` TMPDIR,
all three owned by the sandbox's uid; `gw.sock` the Unix socket in front of the gateway (root-owned).

Every `exec` starts `slime/agent/sandbox_init.py`, which (when this process is root and the host allows
`unshare`) enters private mount and network namespaces, relays 127.0.0.1:<gateway port> inside the namespace
to `gw.sock`, and runs the command as the sandbox's uid under rlimits. Isolation by mode, precisely:

* **isolated** (root, namespaces available — these machines): the command runs as a uid of its own
  (`UID_BASE` + slot, one per live sandbox, no other process uses it); it cannot write outside `root` (no
  write permission elsewhere, and the world-writable /tmp, /var/tmp, /dev/shm, /run/lock are private tmpfs
  mounts); its network namespace holds loopback only, and the one reachable service is the gateway through
  the relay; CPU seconds, address space, processes (per uid) and file size are capped; on exit, timeout or
  cancellation its process group is killed, then every process of its uid. It can still read what the
  host's permissions let any user read (world-readable files), and it shares the host kernel.
* **uid only** (root, no namespaces): as above without the private mounts and network: it can write to the
  host's world-writable directories and open any network connection.
* **fallback** (not root): the command runs as the rollout's own user, in its own process group, with the
  rlimits and the marker sweep (`slime/agent/episode_process.py`); nothing stops it from writing where
  that user can write or from reaching the network. Use `container` or a remote sandbox there.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from slime.agent.episode_process import CliRun, reap_uid, run_cli

logger = logging.getLogger(__name__)

# files an episode's harness leaves in the repository that are not part of the patch
HARNESS_FILES = (".claude", ".codex", "ISSUE.md", "__pycache__", "*.pyc", ".pytest_cache")
UID_BASE = 2_100_000  # far above login users and typical container subuid ranges (100000-165535)
UID_SLOTS = 4096
INIT = Path(__file__).with_name("sandbox_init.py")
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
GIT = ["git", "-c", "user.name=slime", "-c", "user.email=slime@localhost", "-c", "safe.directory=*"]


def diff_command(exclude: tuple[str, ...], base: str = "HEAD") -> list[str]:
    """One shell command printing the working tree's changes against `base`, new files included."""
    specs = " ".join(f"':(exclude,glob)**/{p}' ':(exclude,glob)**/{p}/**'" for p in exclude)
    return [
        "sh",
        "-c",
        f"git add -A -N . >/dev/null 2>&1; git -c core.quotepath=off diff --binary {base} -- . {specs}",
    ]


@functools.cache
def isolation_mode() -> str:
    """`isolated`, `uid` or `fallback` (see the module docstring); probed once per process."""
    if os.geteuid() != 0:
        return "fallback"
    with tempfile.TemporaryDirectory(prefix="slime-sbx-probe-") as d:
        probe = subprocess.run(
            [sys.executable, "-I", "-S", str(INIT), "--probe", d], capture_output=True, text=True, timeout=30
        )
    if probe.returncode != 0:
        logger.warning("sandbox: no private namespaces on this host (%s); uid isolation only", probe.stderr[-200:])
        return "uid"
    return "isolated"


class _UidSlot:
    """A uid no other live sandbox holds, across processes: an flock on `<base>/slime-uid-locks/<uid>` held while alive."""

    def __init__(self, base: Path) -> None:
        d = base / "slime-uid-locks"
        d.mkdir(parents=True, exist_ok=True)
        start = os.getpid() % UID_SLOTS  # spread processes over the range: fewer collisions to skip
        for k in range(UID_SLOTS):
            uid = UID_BASE + (start + k) % UID_SLOTS
            f: IO[bytes] = open(d / str(uid), "wb")  # noqa: SIM115 - held for the sandbox's lifetime
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            self.uid, self._file = uid, f
            return
        raise RuntimeError(f"sandbox: all {UID_SLOTS} sandbox uids are in use")

    def release(self) -> None:
        self._file.close()


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    os.lchown(path, uid, gid)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, gid)


class LocalSandbox:
    def __init__(
        self,
        task_dir: Path,
        gateway: tuple[str, int] | None = None,
        *,
        memory_mb: int = 4096,
        cpu_seconds: int = 0,
        max_processes: int = 512,
        base_dir: str | None = None,
    ) -> None:
        self.task_dir = Path(task_dir)
        self.gateway = gateway
        self.memory_mb, self.cpu_seconds, self.max_processes = memory_mb, cpu_seconds, max_processes
        self.base = Path(base_dir or tempfile.gettempdir())
        self.mode = "fallback"
        self.uid: int | None = None
        self._slot: _UidSlot | None = None
        self._relay: asyncio.AbstractServer | None = None

    @classmethod
    def from_args(cls, args: Any, task_dir: Path, gateway: tuple[str, int] | None) -> LocalSandbox:
        return cls(
            task_dir,
            gateway,
            memory_mb=args.agent_sandbox_memory_mb,
            cpu_seconds=args.agent_sandbox_cpu_seconds or int(max(args.agent_timeout, args.agent_eval_timeout)),
            base_dir=args.agent_sandbox_dir,
        )

    # -- lifecycle -------------------------------------------------------------------------------------------
    async def __aenter__(self) -> LocalSandbox:
        await asyncio.to_thread(self._create)
        try:
            if self._relay_wanted():
                sock = self.root / "gw.sock"
                # AF_UNIX paths stop at 107 bytes and a sandbox dir can be deeper: bind through a directory fd
                dir_fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY)
                try:
                    short = f"/proc/self/fd/{dir_fd}/gw.sock" if len(str(sock).encode()) > 100 else str(sock)
                    self._relay = await asyncio.start_unix_server(self._relay_one, path=short)
                finally:
                    os.close(dir_fd)
                if self.uid is not None:  # the in-sandbox end may run as the sandbox uid (containers)
                    os.chown(sock, self.uid, self.uid)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    def _relay_wanted(self) -> bool:
        """Only with a private network namespace: without one the command reaches the gateway directly."""
        return bool(self.gateway) and self.mode == "isolated"

    def _create(self) -> None:
        self.mode = isolation_mode()
        self.base.mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix="slime-sbx-", dir=self.base))
        self.workdir, self.home, self.tmp = self.root / "work", self.root / "home", self.root / "tmp"
        os.chmod(self.root, 0o711)  # the sandbox uid may pass through, not list or write
        shutil.copytree(self.task_dir, self.workdir, symlinks=True)
        self.home.mkdir()
        self.tmp.mkdir()
        self._git_snapshot()
        if self.mode != "fallback":
            self._slot = _UidSlot(self.base)
            self.uid = self._slot.uid
            for d in (self.workdir, self.home, self.tmp):
                _chown_tree(d, self.uid, self.uid)

    def _git_snapshot(self) -> None:
        """The task as one commit: `export_diff` is the agent's work against it, whatever it touched."""
        (self.workdir / ".git").exists() and shutil.rmtree(self.workdir / ".git")
        env = {"PATH": SAFE_PATH, "HOME": str(self.home), "GIT_CONFIG_NOSYSTEM": "1"}
        cmds = [
            GIT + ["init", "-q"],
            GIT + ["config", "core.checkStat", "minimal"],  # the chown to the sandbox uid must not dirty the index
            GIT + ["add", "-A"],
            GIT + ["commit", "-q", "--no-gpg-sign", "-m", "task"],
        ]
        for cmd in cmds:
            subprocess.run(cmd, cwd=self.workdir, env=env, check=True, capture_output=True, timeout=60)
        # diffs are taken against this commit, not HEAD: an agent that commits its work still exports it
        head = subprocess.run(GIT + ["rev-parse", "HEAD"], cwd=self.workdir, env=env, capture_output=True, text=True)
        self.base_commit = head.stdout.strip()
        with open(self.workdir / ".git" / "info" / "exclude", "a") as f:
            f.write("".join(f"{p}\n" for p in HARNESS_FILES))

    async def __aexit__(
        self, et: type[BaseException] | None = None, ev: BaseException | None = None, tb: TracebackType | None = None
    ) -> None:
        if self._relay is not None:
            self._relay.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._relay.wait_closed(), 2.0)
        if self.uid is not None:
            await asyncio.to_thread(reap_uid, self.uid)
        if hasattr(self, "root"):
            await asyncio.to_thread(shutil.rmtree, self.root, True)
        if self._slot is not None:
            self._slot.release()

    async def _relay_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection from inside the sandbox, piped to the gateway."""
        assert self.gateway is not None
        try:
            up_r, up_w = await asyncio.open_connection(*self.gateway)
        except OSError:
            writer.close()
            return

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(1 << 16):
                    w.write(data)
                    await w.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    w.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

    # -- the protocol ----------------------------------------------------------------------------------------
    def spec(self, cwd: Path | None = None) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "root": str(self.root),
            "cwd": str(cwd or self.workdir),
            "isolate": self.mode == "isolated",
            "uid": self.uid,
            "gid": self.uid,
            "memory_bytes": self.memory_mb << 20 if self.memory_mb else None,
            "cpu_seconds": self.cpu_seconds or None,
            "nproc": self.max_processes,
            "file_bytes": 1 << 30,
        }
        if self.gateway and self.mode == "isolated":
            spec["relay"] = {"port": self.gateway[1], "socket": str(self.root / "gw.sock")}
        return spec

    def command(self, cmd: list[str]) -> list[str]:
        spec = self.spec()
        if cmd and os.path.isabs(cmd[0]):  # an installed CLI (e.g. .agent-clis in a checkout under /tmp) stays visible
            spec["keep"] = [os.path.dirname(os.path.realpath(cmd[0]))]
        return [sys.executable, "-I", "-S", str(INIT), json.dumps(spec), "--", *cmd]

    async def exec(
        self, cmd: list[str], env: dict[str, str], timeout_s: float, *, stdin: bytes | None = None
    ) -> CliRun:
        env = {**env, "PATH": env.get("PATH") if self.mode == "fallback" else SAFE_PATH}
        env.setdefault("HOME", str(self.home))
        env["TMPDIR"] = str(self.tmp)  # the sandbox root itself is not writable by the sandbox uid
        sweep = (lambda: reap_uid(self.uid)) if self.uid is not None else None
        return await run_cli(
            self.command(cmd), cwd=str(self.root), env=env, timeout_s=timeout_s, sweep=sweep, stdin=stdin
        )

    def _inside(self, path: str | Path) -> Path:
        p = Path(path) if Path(path).is_absolute() else self.workdir / path
        if not p.resolve().is_relative_to(self.root.resolve()):
            raise ValueError(f"{path}: outside the sandbox")
        return p

    async def write_file(self, path: str | Path, data: str | bytes) -> None:
        p = self._inside(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)
        if self.uid is not None:
            for q in [p, *p.parents]:
                if q == self.root or not q.is_relative_to(self.root):
                    break
                os.lchown(q, self.uid, self.uid)

    async def read_file(self, path: str | Path) -> str:
        return self._inside(path).read_text(errors="replace")

    async def export_diff(self, exclude: tuple[str, ...] = HARNESS_FILES) -> str:
        run = await self.exec(diff_command(exclude, self.base_commit), {"HOME": str(self.home)}, 120.0)
        if run.returncode != 0:
            raise RuntimeError(f"export_diff failed ({run.returncode}): {run.stderr[-300:]}")
        return run.stdout
