"""bench/suite_cpu.py: the suite's processes land in the right roles, and a process older than the suite counts
only the CPU it spent during it (otherwise the shell and the machine's daemons would be charged their whole life)."""

import os
import subprocess
import sys
import time

import pytest

from bench.suite_cpu import role, sample

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize(
    ("cmdline", "name", "want"),
    [
        ("", "kdamond.0", "kernel kdamond.0"),
        ("", "kworker/u8:3-ext4", "kernel kworker"),
        ("/x/python -c import sys;exec(eval(sys.stdin.readline()))", "[pytest-xdist idle]", "pytest (controller and workers)"),
        ("/x/python -m pytest -m cpu -n 2", "python", "pytest (controller and workers)"),
        ("/x/python -B -c from multiprocessing.forkserver import main; main(13, 15)", "python", "test ranks (fork server, spawned)"),
        ("ray::TrainRayActor.train", "python", "ray::TrainRayActor"),
        ("/x/python -m sim.fake_sglang --host 127.0.0.1", "python", "fake engine"),
        ("/x/python -m examples.toy.prepare --out /tmp/a", "python", "python -m examples.toy.prepare"),
        ("node /x/node_modules/.bin/claude -p hi", "claude", "agent CLI claude"),
        ("/usr/bin/git status", "git", "git"),
    ],
)  # fmt: skip
def test_role(cmdline, name, want):
    assert role(cmdline, name) == want


def test_a_process_older_than_the_suite_counts_only_its_cpu_since():
    # 0.6 s of the child's own CPU (not wall time: a loaded machine gives it less), then it says so and sleeps
    burn = "import time\nwhile time.process_time() < 0.6: pass\nprint('ready', flush=True)\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        processes: dict = {}
        sample(processes, os.getpid(), since=time.time())
        (entry,) = [e for (pid, _), e in processes.items() if pid == child.pid]
        assert entry["base"] > 0.3 and entry["cpu_s"] < 0.1
        young: dict = {}
        sample(young, os.getpid(), since=0.0)  # every process is younger than the epoch: all its CPU counts
        (entry,) = [e for (pid, _), e in young.items() if pid == child.pid]
        assert entry["base"] == 0.0 and entry["cpu_s"] > 0.3
    finally:
        child.kill()
        child.wait()
