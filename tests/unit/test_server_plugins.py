"""Server plugins: an engine other than SGLang enters slime by entry point or import path, bringing its own flags,
YAML block and server argv (slime/backends/sglang/server_plugins.py). The simulator is one (registered in
pyproject.toml); a third-party one is defined here and named by import path."""

from __future__ import annotations

import argparse
import sys

import pytest

from slime.arguments import parse_args
from slime.backends.sglang import server_plugins
from slime.backends.sglang.server_args import build_server_argv
from slime.backends.sglang.server_plugins import ServerSpec
from slime.utils.errors import SlimeArgError

pytestmark = pytest.mark.cpu


class EchoServers:
    """A stand-in third-party engine: its own flag, one YAML key, its own command line."""

    name = "echo"
    stands_in_without_cuda = False
    model_keys = {"voice": "echo_voice"}
    path_keys = frozenset()

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--echo-voice", default="low")

    def validate(self, args: argparse.Namespace) -> None:
        if args.echo_voice not in ("low", "high"):
            raise SlimeArgError(f"--echo-voice {args.echo_voice}: expected low or high")

    def check_model_block(self, block: dict) -> str | None:
        return None

    def server_argv(self, args: argparse.Namespace, spec: ServerSpec) -> list[str]:
        return [sys.executable, "-m", "echo_server", "--port", str(spec.port), "--voice", args.echo_voice]


PATH = f"{__name__}:EchoServers"
BASE = ["--rollout-batch-size", "1", "--num-rollout", "1", "--rollout-num-gpus", "1"]


def _argv(tmp_path, *extra: str) -> list[str]:
    (tmp_path / "config.json").write_text("{}")
    return [*BASE, "--hf-checkpoint", str(tmp_path), "--rollout-engine", PATH, *extra]


def test_the_simulator_is_registered_and_builds_its_argv(make_args):
    assert set(server_plugins.registered()) == {"sim"}
    assert server_plugins.stand_in() is server_plugins.registered()["sim"]
    args = make_args(sim_engine="synthetic", sim_synthetic_config="lat.json")
    argv = build_server_argv(args, backend="sim", host="127.0.0.1", port=4000)
    assert argv[:3] == [sys.executable, "-m", "sim.fake_sglang"] and "--synthetic-config" in argv


def test_a_plugin_named_by_import_path_brings_its_flags_and_argv(tmp_path):
    args = parse_args(_argv(tmp_path, "--echo-voice", "high"))
    assert args.echo_voice == "high"
    argv = build_server_argv(args, backend=PATH, host="127.0.0.1", port=4321)
    assert argv == [sys.executable, "-m", "echo_server", "--port", "4321", "--voice", "high"]
    with pytest.raises(SlimeArgError, match="--echo-voice loud: expected low or high"):
        parse_args(_argv(tmp_path, "--echo-voice", "loud"))


def test_unknown_engines_are_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(
        SlimeArgError, match=r"--rollout-engine vllm: not a registered engine plugin \(sglang, auto, sim\)"
    ):
        parse_args([*BASE, "--hf-checkpoint", str(tmp_path), "--rollout-engine", "vllm"])
    with pytest.raises(SlimeArgError, match="--rollout-engine no.such.module:Thing: cannot load it"):
        parse_args([*BASE, "--hf-checkpoint", str(tmp_path), "--rollout-engine", "no.such.module:Thing"])
