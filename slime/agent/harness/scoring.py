"""Scoring a repository task's patch in a fresh sandbox: reward 1.0 iff every fail-to-pass and pass-to-pass test
passes, with nothing of the test harness under the patch's control.

The reward is what an RL policy optimises, so every way to pass the tests without fixing the bug is closed by
construction rather than by checking the patch:

1. **The test tree is the task's.** The patch's changes to the test tree (the directories of the task's test
   files, and a module that would shadow their package) and to test-harness files anywhere (`conftest.py`,
   `pytest.ini`, ...) are not applied (`git apply --exclude`); then git must report those paths unchanged
   against the task's commit, else the patch reached them some other way and scores 0.
2. **The runner and the standard library cannot be shadowed**, and 3. **the verdict is read from a channel the
   code under test cannot print to, and the runner's exit status must be 0**: `unittest_runner.py`, sent as
   `python3 -I -c <source>`, explains how.

A task is the sample's metadata (`RepoTask`): `instance_id`, `repo` (a directory; relative paths are taken from
the `--prompt-data` file's directory), `fail_to_pass` and `pass_to_pass` (unittest ids), `test_files`.
"""

from __future__ import annotations

import fnmatch
import json
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from slime.agent.sandbox import Sandbox, make_sandbox
from slime.utils.types import Sample

RUNNER = Path(__file__).with_name("unittest_runner.py")
# files that configure a test run wherever they are (pytest reads them; a task adapted to pytest is covered)
_DIFF_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.M)
HARNESS_FILES = ("conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "sitecustomize.py", "*.pth")


@dataclass
class RepoTask:
    instance_id: str
    repo: Path
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    test_files: list[str]

    @classmethod
    def from_sample(cls, args: Any, sample: Sample) -> RepoTask:
        m = sample.metadata
        repo = Path(m["repo"])
        if not repo.is_absolute() and args.prompt_data:
            repo = Path(args.prompt_data).resolve().parent / repo
        if not repo.is_dir():
            raise FileNotFoundError(f"task {m.get('instance_id')}: repository {repo} not found")
        return cls(
            str(m["instance_id"]), repo, list(m["fail_to_pass"]), list(m["pass_to_pass"]), list(m["test_files"])
        )


def guarded_roots(test_files: list[str]) -> list[str]:
    """Roots of the task's test tree: each test file's directory, widened to its `test*` ancestors
    (`tests/unit/test_a.py` -> `tests`); a test file at the repository's top is a root of its own."""
    roots: set[str] = set()
    for f in test_files:
        *dirs, name = PurePosixPath(f).parts
        n = len(dirs)
        while n > 1 and dirs[n - 2].startswith("test"):
            n -= 1
        roots.add("/".join(dirs[:n]) if dirs else name)
    return sorted(r for r in roots if not any(r.startswith(o + "/") for o in roots))


def excluded_patterns(test_files: list[str]) -> list[str]:
    """`git apply --exclude` patterns (wildmatch without pathname mode: `*` crosses `/`) for every path the
    patch may not touch: the test tree, a module next to a test package that would shadow it (`tests.py`),
    and harness files at any depth."""
    out: list[str] = []
    for root in guarded_roots(test_files):
        out += [root, f"{root}/*", f"{root}.*"]
    for name in HARNESS_FILES:
        out += [name, f"*/{name}"]
    return out


def guarded_pathspecs(test_files: list[str]) -> list[str]:
    """The same paths as git pathspecs, to check that the applied patch left them as the task has them."""
    out: list[str] = []
    for root in guarded_roots(test_files):
        out += [f":(literal){root}", f":(glob){root}.*"]
    return out + [f":(glob)**/{name}" for name in HARNESS_FILES]


def dropped_files(patch: str, test_files: list[str]) -> list[str]:
    """Paths of the patch's file sections that `excluded_patterns` keeps out (what the metadata reports)."""
    pats = excluded_patterns(test_files)
    paths = {p for m in _DIFF_HEADER.finditer(patch) for p in m.groups()}
    return sorted(p for p in paths if any(fnmatch.fnmatchcase(p, pat) for pat in pats))


def verdict_of(stdout: str, nonce: str) -> dict[str, Any] | None:
    """The runner's verdict line: the last JSON line on its private channel carrying our nonce."""
    for line in reversed(stdout.splitlines()):
        try:
            v = json.loads(line)
        except ValueError:
            continue
        if isinstance(v, dict) and v.get("nonce") == nonce and isinstance(v.get("results"), dict):
            return v
    return None


async def _apply(sb: Sandbox, task: RepoTask, patch: str, env: dict[str, str], budget: float) -> str | None:
    """Apply the patch without the guarded paths; the method that worked (3way | plain) or None."""
    excludes = [f"--exclude={p}" for p in excluded_patterns(task.test_files)]
    for method, flags in (("3way", ["--3way"]), ("plain", [])):
        run = await sb.exec(["git", "apply", *flags, *excludes, "-"], env, budget, stdin=patch.encode())
        if run.returncode == 0:
            return method
        await sb.exec(["git", "checkout", "-f", sb.base_commit, "--", "."], env, budget)
    return None


async def _guarded_changes(sb: Sandbox, task: RepoTask, env: dict[str, str], budget: float) -> list[str]:
    cmd = ["git", "status", "--porcelain", "--ignored", "--untracked-files=all", "--"]
    run = await sb.exec(cmd + guarded_pathspecs(task.test_files), env, budget)
    if run.returncode != 0:
        raise RuntimeError(f"checking the test tree failed: {run.stderr[-300:]}")
    return [line[3:] for line in run.stdout.splitlines() if line.strip()]


async def score_patch(args: Any, task: RepoTask, patch: str) -> dict[str, Any]:
    """Apply `patch` to a fresh sandbox of the task and run its tests there (module docstring). Reward 1.0 iff
    every fail-to-pass and pass-to-pass test passes."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"applied_cleanly": False, "apply_method": None, "tests_passed": [], "tests_failed": []}
    wanted = task.fail_to_pass + task.pass_to_pass
    budget = float(args.agent_eval_timeout)
    passed = False
    async with make_sandbox(args, task.repo, None) as sb:
        env = {"HOME": str(sb.home)}
        method = await _apply(sb, task, patch, env, budget) if patch.strip() else None
        out["dropped_files"] = dropped_files(patch, task.test_files)
        out["applied_cleanly"], out["apply_method"] = method == "3way", method
        touched = await _guarded_changes(sb, task, env, budget) if method else []
        if touched:  # the patch reached the test tree past the exclusions
            out["verdict"], out["tests_tampered"] = "tampered", touched[:20]
        elif method:
            nonce = secrets.token_hex(16)
            cmd = ["python3", "-I", "-c", RUNNER.read_text(), *wanted]
            run = await sb.exec(cmd, env, budget, stdin=f"{nonce}\n".encode())
            verdict = verdict_of(run.stdout, nonce)
            out.update(runner_exit_code=run.returncode, tests_timed_out=run.timed_out)
            if verdict is None:  # the run ended before the runner wrote one (an exit from the code under test)
                out["verdict"] = "missing"
            elif verdict.get("tampered"):  # the test framework changed while the tests ran
                out["verdict"], out["tests_tampered"] = "tampered", verdict["tampered"]
            else:
                out["verdict"] = "ok"
                out["tests_passed"] = [t for t in wanted if verdict["results"].get(t) == "passed"]
            passed = out["verdict"] == "ok" and run.returncode == 0
        out["tests_failed"] = [t for t in wanted if t not in out["tests_passed"]]
    passed = passed and not out["tests_failed"] and bool(wanted)
    out["reward"] = float(passed)
    out["score_seconds"] = round(time.monotonic() - t0, 3)
    return out
