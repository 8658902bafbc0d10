"""The `local` sandbox (slime/agent/local_sandbox.py) and patch scoring (slime/agent/harness/repo_task.py).

Isolation claims are checked from inside real sandboxes: writes outside the sandbox directory, processes
outliving a command (setsid, nohup, a timeout), network other than the gateway. Scoring is checked on every
task of the coding-agent example: the known-good patch scores 1, no patch 0, and the scripted policy's
wrong / test-editing / test-deleting patches 0 (the patch's changes to the tests are not applied); every
red-team patch (bug left in place, tests passed another way) scores 0, each for its door's reason. The container
sandbox is checked by the command line it builds: no container runtime daemon runs on these machines.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from examples.coding_agent.scripted_policy import OUTCOMES, REDTEAM, policy_patch, redteam_patch
from slime.agent.container_sandbox import INIT_IN_CONTAINER, ContainerSandbox
from slime.agent.harness.scoring import RepoTask, excluded_patterns, guarded_roots, score_patch, verdict_of
from slime.agent.local_sandbox import UID_BASE, UID_SLOTS, LocalSandbox, isolation_mode
from slime.agent.sandbox import Sandbox, make_sandbox
from slime.utils.async_utils import run

pytestmark = pytest.mark.cpu

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "coding_agent"
ROWS = [json.loads(line) for line in (EXAMPLE / "tasks.jsonl").read_text().splitlines()]


def task(iid: str) -> RepoTask:
    (m,) = [r["metadata"] for r in ROWS if r["metadata"]["instance_id"] == iid]
    return RepoTask(iid, EXAMPLE / m["repo"], m["fail_to_pass"], m["pass_to_pass"], m["test_files"])


def need_isolation() -> None:
    if isolation_mode() != "isolated":
        pytest.skip("needs root and unshare (private mount + network namespaces)")


def sandbox_procs(uid: int | None) -> list[str]:
    """Processes of one sandbox's uid (other sandboxes may be running in parallel tests)."""
    assert uid is not None and UID_BASE <= uid < UID_BASE + UID_SLOTS
    out = []
    for p in psutil.process_iter(["uids", "cmdline", "status"]):
        if p.info["status"] == psutil.STATUS_ZOMBIE:  # dead, not yet reaped by this host's pid 1
            continue
        uids = p.info["uids"]
        if uids is not None and uid in (uids.real, uids.effective):
            out.append(" ".join(p.info["cmdline"] or []))
    return out


@pytest.fixture
def http_server() -> Iterator[int]:
    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"hello-from-gateway")

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


def test_protocol_and_factory(make_args, tmp_path: Path) -> None:
    sb = make_sandbox(
        make_args(agent_sandbox="local", agent_sandbox_dir=str(tmp_path)), EXAMPLE / "tasks" / "clamp-high", None
    )
    assert isinstance(sb, LocalSandbox)

    async def entered() -> bool:
        async with sb:
            return isinstance(sb, Sandbox)  # every member of the protocol, once booted

    assert run(entered())


def test_nothing_lands_outside_and_nothing_survives(tmp_path: Path) -> None:
    need_isolation()
    tag = uuid.uuid4().hex[:10]
    outside = [Path(f"/tmp/escape-{tag}"), Path(f"/var/tmp/escape-{tag}"), Path(f"/dev/shm/escape-{tag}")]
    outside += [tmp_path / f"escape-{tag}", EXAMPLE / f"escape-{tag}"]

    async def episode() -> tuple[Path, str, list[str]]:
        async with LocalSandbox(EXAMPLE / "tasks" / "clamp-high", base_dir=str(tmp_path)) as sb:
            writes = "; ".join(f"echo x > {p} 2>/dev/null" for p in outside)
            script = (
                f"{writes}; echo ok > inside.txt; (setsid sleep 913.{tag[:3]} &) ; nohup sleep 914 >/dev/null 2>&1 &"
            )
            res = await sb.exec(["sh", "-c", script], {}, 30)
            inside = (sb.workdir / "inside.txt").read_text()
            hang = await sb.exec(["sh", "-c", "sleep 915 & sleep 916"], {}, 1.0)
            assert hang.timed_out and res.returncode == 0
            left = sandbox_procs(sb.uid)  # after both commands, inside the sandbox's lifetime
            return sb.root, inside, left

    root, inside, left = run(episode())
    assert inside == "ok\n"
    assert not left, left
    assert [p for p in outside if p.exists()] == []
    assert not root.exists()


def test_gateway_reached_from_a_deep_sandbox_dir(tmp_path: Path, http_server: int) -> None:
    """A sandbox dir deeper than an AF_UNIX path allows (107 bytes; seen under pytest-xdist's tmp dirs): the relay
    socket is bound and reached through a directory fd."""
    need_isolation()
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    get = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"

    async def episode() -> str:
        async with LocalSandbox(
            EXAMPLE / "tasks" / "clamp-high", ("127.0.0.1", http_server), base_dir=str(deep)
        ) as sb:
            assert len(str(sb.root / "gw.sock").encode()) > 107
            return (await sb.exec(["python3", "-c", get, f"http://127.0.0.1:{http_server}/"], {}, 30)).stdout

    assert run(episode()).strip() == "hello-from-gateway"


def test_a_command_installed_under_tmp_stays_visible(tmp_path: Path) -> None:
    """CI's checkout (and so `.agent-clis`) may live under /tmp, which the sandbox covers with a fresh tmpfs: the
    command's own directory is bound back in (seen: Claude Code vanished inside the sandbox of a /tmp clone)."""
    need_isolation()
    tool_dir = tmp_path / "prefix" / "bin"
    tool_dir.mkdir(parents=True)
    tool = tool_dir / "hello-tool"
    tool.write_text("#!/bin/sh\necho tool-ran\n")
    tool.chmod(0o755)
    (tmp_path / "prefix" / "secret.txt").write_text("not for the agent")
    for d in (tmp_path, tmp_path.parent, tmp_path.parent.parent, tmp_path / "prefix", tool_dir):
        d.chmod(d.stat().st_mode | 0o011)  # pytest's own dirs are 0700: the sandbox uid must traverse them

    async def episode() -> tuple[str, int]:
        async with LocalSandbox(EXAMPLE / "tasks" / "clamp-high", None, base_dir=str(tmp_path)) as sb:
            ran = await sb.exec([str(tool)], {}, 30)
            # only the tool's own directory came back, not its neighbours
            leaked = await sb.exec(["cat", str(tmp_path / "prefix" / "secret.txt")], {}, 30)
            return ran.stdout, leaked.returncode

    out, cat_rc = run(episode())
    assert out.strip() == "tool-ran" and cat_rc != 0


def test_network_is_the_gateway_only(tmp_path: Path, http_server: int) -> None:
    need_isolation()
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    other_port = other.server_address[1]
    get = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"

    async def episode() -> tuple[str, int, int]:
        async with LocalSandbox(
            EXAMPLE / "tasks" / "clamp-high", ("127.0.0.1", http_server), base_dir=str(tmp_path)
        ) as sb:
            ok = await sb.exec(["python3", "-c", get, f"http://127.0.0.1:{http_server}/"], {}, 30)
            blocked = await sb.exec(["python3", "-c", get, f"http://127.0.0.1:{other_port}/"], {}, 30)
            outside = await sb.exec(["python3", "-c", get, "http://10.0.0.1:80/"], {}, 30)
            return ok.stdout, blocked.returncode, outside.returncode

    try:
        body, blocked_rc, outside_rc = run(episode())
    finally:
        other.server_close()
    assert body.strip() == "hello-from-gateway"
    assert blocked_rc != 0 and outside_rc != 0


def test_runs_as_its_own_user_with_limits(tmp_path: Path) -> None:
    need_isolation()

    async def episode() -> tuple[str, str]:
        async with LocalSandbox(EXAMPLE / "tasks" / "clamp-high", base_dir=str(tmp_path), memory_mb=512) as sb:
            who = await sb.exec(["sh", "-c", "id -u; ulimit -v"], {}, 30)
            big = await sb.exec(["python3", "-c", "x = bytearray(1 << 30)"], {}, 30)
            return who.stdout, str(big.returncode) + big.stderr

    who, big = run(episode())
    uid, vmem = who.split()
    assert UID_BASE <= int(uid) < UID_BASE + UID_SLOTS and int(vmem) == 512 * 1024
    assert "MemoryError" in big


def test_export_diff_has_the_agents_changes_only(tmp_path: Path) -> None:
    async def episode() -> str:
        async with LocalSandbox(EXAMPLE / "tasks" / "clamp-high", base_dir=str(tmp_path)) as sb:
            script = (
                "echo '# more' >> clamp.py && echo new > added.py && mkdir -p .claude && echo h > .claude/x && "
                "echo issue > ISSUE.md && python3 -c 'import clamp' && git add -A && git -c user.name=a -c user.email=a@a commit -qm mine"
            )
            res = await sb.exec(["sh", "-c", script], {}, 30)
            assert res.returncode == 0, res.stderr
            return await sb.export_diff()

    diff = run(episode())
    files = sorted(line.split(" b/")[1] for line in diff.splitlines() if line.startswith("diff --git"))
    assert files == ["added.py", "clamp.py"]  # committed work still exported; harness files and caches not


@pytest.mark.parametrize("iid", sorted(OUTCOMES))
def test_every_task_scores_its_known_outcome(iid: str, make_args, tmp_path: Path) -> None:
    args = make_args(agent_sandbox="local", agent_sandbox_dir=str(tmp_path), agent_eval_timeout=60.0)
    t = task(iid)
    good = run(score_patch(args, t, (EXAMPLE / "solutions" / f"{iid}.patch").read_text()))
    assert good["reward"] == 1.0 and good["applied_cleanly"], good
    none = run(score_patch(args, t, ""))
    assert none["reward"] == 0.0 and none["apply_method"] is None
    if OUTCOMES[iid] != "good":
        bad = run(score_patch(args, t, policy_patch(iid)))
        assert bad["reward"] == 0.0 and bad["apply_method"] is not None, bad
        assert set(bad["tests_failed"]) & set(t.fail_to_pass), bad
        assert bool(bad["dropped_files"]) == (OUTCOMES[iid] != "wrong"), bad  # test edits are never applied
        assert set(bad["tests_passed"]) == set(t.pass_to_pass) or OUTCOMES[iid] == "wrong", bad


@pytest.mark.parametrize("door,name,iid", REDTEAM, ids=[n for _, n, _ in REDTEAM])
def test_redteam_patch_scores_zero(door: str, name: str, iid: str, make_args, tmp_path: Path) -> None:
    args = make_args(agent_sandbox="local", agent_sandbox_dir=str(tmp_path), agent_eval_timeout=60.0)
    t = task(iid)
    got = run(score_patch(args, t, redteam_patch(name)))
    assert got["reward"] == 0.0 and got["apply_method"] is not None, got
    assert set(got["tests_failed"]) & set(t.fail_to_pass), got
    if door == "test-tree":  # its change to the test tree was not applied: the real tests ran and failed
        assert got["dropped_files"] and got["verdict"] == "ok", got
    elif door == "runner":  # the standard library's unittest ran the task's tests
        assert got["verdict"] == "ok" and set(got["tests_passed"]) == set(t.pass_to_pass), got
    elif door == "verdict":  # what it printed is no verdict, and it exited before one was written
        assert got["verdict"] == "missing", got
    else:
        assert got["verdict"] == "tampered" and got["tests_tampered"], got


def test_a_patch_that_reaches_the_tests_past_the_exclusions_scores_zero(make_args, tmp_path: Path) -> None:
    """`git apply --exclude` looks at a rename's new name only: the guard (git status on the test tree) catches it."""
    args = make_args(agent_sandbox="local", agent_sandbox_dir=str(tmp_path), agent_eval_timeout=60.0)
    good = (EXAMPLE / "solutions" / "stack-peek.patch").read_text()
    rename = "diff --git a/tests/test_stack.py b/moved.py\nsimilarity index 100%\nrename from tests/test_stack.py\nrename to moved.py\n"
    got = run(score_patch(args, task("stack-peek"), good + rename))
    assert got["reward"] == 0.0 and got["verdict"] == "tampered", got
    assert any("tests/test_stack.py" in p for p in got["tests_tampered"]), got


def test_test_tree_and_excluded_paths() -> None:
    assert guarded_roots(["tests/test_a.py", "tests/unit/test_b.py"]) == ["tests"]
    assert guarded_roots(["pkg/tests/test_a.py", "test_top.py"]) == ["pkg/tests", "test_top.py"]
    pats = excluded_patterns(["tests/test_a.py"])
    assert {"tests", "tests/*", "tests.*", "conftest.py", "*/conftest.py"} <= set(pats)
    assert not {"tests_helper.py", "pkg/mod.py"} & set(pats)


def test_verdict_needs_the_nonce() -> None:
    forged = json.dumps({"nonce": "", "results": {"t": "passed"}})
    real = json.dumps({"nonce": "n1", "results": {"t": "failed"}})
    assert verdict_of(f"{forged}\n", "n1") is None
    assert verdict_of(f"{real}\nnoise\n{forged}\n", "n1") == {"nonce": "n1", "results": {"t": "failed"}}


def test_container_command_line(tmp_path: Path) -> None:
    """What `--agent-sandbox container` runs (no docker daemon here: the command is checked, not run)."""
    sb = ContainerSandbox(
        EXAMPLE / "tasks" / "clamp-high", ("127.0.0.1", 4321), image="img:1", runtime="/usr/bin/docker",
        base_dir=str(tmp_path), memory_mb=1024,
    )  # fmt: skip

    async def build() -> list[str]:
        async with sb:
            assert sb.mode == "container" and (sb.root / "gw.sock").exists()
            return sb.container_command(["/bin/true", "x"], {"PATH": "/p", "SECRET_KEY": "sk-123"}, "c1")

    cmd = run(build())
    assert cmd[:3] == ["/usr/bin/docker", "run", "--rm"] and cmd[cmd.index("--network") + 1] == "none"
    assert cmd[cmd.index("--memory") + 1] == "1024m" and f"{sb.root}:{sb.root}" in cmd
    assert "sk-123" not in " ".join(cmd) and cmd[cmd.index("-e") + 1] == "SECRET_KEY" and "PATH" not in cmd
    img = cmd.index("img:1")
    spec = json.loads(cmd[img + 5])
    assert cmd[img + 1 : img + 5] == ["python3", "-I", "-S", INIT_IN_CONTAINER] and cmd[-2:] == ["/bin/true", "x"]
    assert spec["relay"] == {"port": 4321, "socket": str(sb.root / "gw.sock")} and spec["isolate"] is False
    assert not sb.root.exists()


def test_cancelled_command_leaves_nothing(tmp_path: Path) -> None:
    need_isolation()

    async def episode() -> list[str]:
        async with LocalSandbox(EXAMPLE / "tasks" / "clamp-high", base_dir=str(tmp_path)) as sb:
            task_ = asyncio.create_task(sb.exec(["sh", "-c", "(setsid sleep 917 &); sleep 918"], {}, 60))
            await asyncio.sleep(1.0)
            task_.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task_
            return sandbox_procs(sb.uid)

    assert run(episode()) == []
