"""Root pytest hooks: every test must be marked `cpu` or `gpu`; under CI=true a cpu test may not skip.

Why: a test that silently skips in CI proves nothing (docs/testing.md). Real components are installed by
.ci/run, so a skip there means a broken install, which must fail loudly.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tests.hypothesis_budget  # noqa: E402,F401 - loads the hypothesis profile (ci: full counts, dev: a fifth)


@pytest.fixture(scope="session", autouse=True)
def _fake_engine_zygote():
    """Fake CPU engines start as forks of one pre-imported process per test worker (sim/fake_sglang/zygote.py):
    ~0.8 s instead of ~9 CPU-seconds each. `SLIME_SIM_ZYGOTE=0` turns it off; a GPU host never uses it."""
    if os.environ.get("SLIME_SIM_ZYGOTE") == "0":
        yield None
        return
    from slime.utils.cuda import cuda_available

    if cuda_available():
        yield None
        return
    from sim.fake_sglang.zygote import zygote

    with zygote() as path:
        yield path


def pytest_sessionstart(session: pytest.Session) -> None:
    """The quick start installs the test dependencies in the background; a suite started before that install
    ends would skip what it has not installed yet, so it waits (with one line saying why)."""
    if hasattr(session.config, "workerinput"):  # xdist workers: the controller already waited
        return
    import time
    from pathlib import Path

    pid_file = Path(__file__).resolve().parent / ".test-deps.pid"
    announced = False
    while pid_file.exists():
        try:
            os.kill(int(pid_file.read_text().strip()), 0)
        except (ValueError, ProcessLookupError, PermissionError):
            break
        if not announced:
            print("\nwaiting for the background install of the test dependencies (log: runs/install-test-deps.log)")
            announced = True
        time.sleep(2)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [it.nodeid for it in items if not ({"cpu", "gpu"} & {m.name for m in it.iter_markers()})]
    if unmarked:
        raise pytest.UsageError("tests without a `cpu` or `gpu` marker (docs/testing.md):\n  " + "\n  ".join(unmarked))
    for it in items:
        names = {m.name for m in it.iter_markers()}
        if "slow" in names and "cpu" not in names:
            raise pytest.UsageError(f"{it.nodeid}: `slow` tests must also carry `cpu`")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") == "true" and report.skipped and item.get_closest_marker("cpu") is not None:
        if not hasattr(report, "wasxfail"):
            report.outcome = "failed"
            report.longrepr = f"cpu test skipped under CI=true (skips are failures in CI): {report.longrepr}"


@pytest.fixture
def make_args():
    """`make_args(**overrides)`: test args built from the real parser (its defaults), never a hand-made namespace.

    Property tests, which cannot take function-scoped fixtures inside `@given`, call
    `slime.arguments.default_args` directly: it is this fixture."""
    from slime.arguments import default_args

    return default_args
