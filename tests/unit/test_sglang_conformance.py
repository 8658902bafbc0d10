"""Replay the conformance fixtures recorded from real SGLang (tests/fixtures/sglang-<version>/, written by
scripts/record_sglang_conformance.py) against the fake and check every recorded field's presence, type and shape,
and the values at each fixture's deterministic paths (sim/fake_sglang/conformance.py).

The fake runs the toy model the fixtures were recorded with (examples/toy/prepare.py's checkpoint), told the
recorded server's version where it takes `--sglang-version`. Its values differ (its numerics are not SGLang's);
its shapes must not. No fixture directory is a failure, not a pass."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sim.fake_sglang.conformance import compare_fixture, load_fixture_dir
from sim.fake_sglang.testing import fake_env, launch_fake_sglang

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
COMMITTED = sorted(p for p in FIXTURES.glob("sglang-*") if (p / "index.json").is_file())
# SLIME_CONFORMANCE_DIRS (os.pathsep-separated) replays other directories instead: a fresh recording before it is
# committed, or one recorded from the fake while developing the recorder (never committed).
_OVERRIDE = [Path(p) for p in os.environ.get("SLIME_CONFORMANCE_DIRS", "").split(os.pathsep) if p]
FIXTURE_DIRS = _OVERRIDE or COMMITTED


def load_recorder():
    spec = importlib.util.spec_from_file_location(
        "record_sglang_conformance", ROOT / "scripts" / "record_sglang_conformance.py"
    )  # noqa: E501
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fake_versions() -> list[str]:
    """The releases `python -m sim.fake_sglang --sglang-version` accepts (none: the option does not exist)."""
    out = subprocess.run(
        [sys.executable, "-m", "sim.fake_sglang", "--help"], capture_output=True, text=True, env=fake_env(), timeout=60
    ).stdout
    m = re.search(r"--sglang-version \{([^}]*)\}", out)
    return m.group(1).split(",") if m else []


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory) -> Path:
    from examples.toy.prepare import prepare

    return prepare(tmp_path_factory.mktemp("conformance_toy"), num_train=1, num_eval=1)["model"]


@pytest.mark.parametrize("fixture_dir", FIXTURE_DIRS or [None], ids=[p.name for p in FIXTURE_DIRS] or ["none"])
def test_fake_answers_in_the_recorded_shapes(fixture_dir: Path | None, request: pytest.FixtureRequest):
    assert fixture_dir is not None, (
        f"no conformance fixtures under {FIXTURES}/sglang-<version>/: record them from a real SGLang server with "
        "scripts/record_sglang_conformance.py (docs/testing.md, 'Conformance fixtures')"
    )
    toy_model = request.getfixturevalue("toy_model")  # built only once there is something to replay
    index, fixtures = load_fixture_dir(fixture_dir)
    assert fixtures, f"{fixture_dir}/index.json lists no cases"
    version = index.get("server_version")
    args = ["--engine", "hf", "--model-path", str(toy_model), "--random-seed", "0"]
    if version in fake_versions():
        args += ["--sglang-version", version]
    if "--enable-deterministic-inference" in (index.get("server_argv") or "").split():
        args.append("--enable-deterministic-inference")  # the recorded server honoured sampling_seed: so must the fake
    recorder = load_recorder()
    replayed = {}
    with launch_fake_sglang(args) as fake:
        for fx in fixtures:
            replayed[fx["case"]] = recorder.run_case(fake.url, fx)
    diffs = [d for fx in fixtures for d in compare_fixture(fx, replayed[fx["case"]])]
    report = "\n".join(str(d) for d in diffs)
    assert not diffs, f"the fake differs from {fixture_dir.name} in {len(diffs)} places:\n{report}"

    # Not vacuous: the same comparison fails once a recorded field is missing from the fake's answer.
    gen = next(fx for fx in fixtures if fx["case"] == "generate_ids")
    broken = copy.deepcopy(replayed["generate_ids"])
    del next(s for s in broken["steps"] if s["name"] == "main")["response"]["json"]["meta_info"]["prompt_tokens"]
    assert [(d.path, d.kind) for d in compare_fixture(gen, broken)] == [
        ("main.response.json.meta_info.prompt_tokens", "missing"),
        ("response.json.meta_info.prompt_tokens", "missing"),
    ]


def test_fixtures_are_recordings_of_a_real_server():
    """A fixture directory holds what a real SGLang answered: its index names a version and the server's argv."""
    for d in COMMITTED:
        index = json.loads((d / "index.json").read_text())
        assert d.name == f"sglang-{index['server_version']}", (d, index.get("server_version"))
        assert "sglang" in (index.get("server_argv") or ""), f"{d}: index.json names no SGLang server argv"
        assert "fake_sglang" not in index["server_argv"], f"{d} was recorded from the fake"
