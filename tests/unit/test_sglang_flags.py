"""`--sglang-*` / `--router-*` pass-through: validated against the committed snapshots, which must equal the
live parsers (the router's here; SGLang's in tests/unit/test_server_args.py, which runs the side venv once)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slime.backends.sglang import flags
from slime.backends.sglang.flags import (
    SKIPPED_SGLANG_FLAGS,
    add_router_arguments,
    add_sglang_arguments,
    check_unknown_prefixed,
    load_router_snapshot,
    load_sglang_snapshot,
    router_overrides_from_args,
    sglang_overrides_from_args,
    validate_override_keys,
)
from slime.utils.errors import SlimeArgError
from tests.hypothesis_budget import examples

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slime train", allow_abbrev=False)
    add_sglang_arguments(p)
    add_router_arguments(p)
    return p


def _parse(argv: list[str]) -> argparse.Namespace:
    args, unknown = _parser().parse_known_args(argv)
    check_unknown_prefixed(unknown)
    assert not unknown, unknown
    return args


def _error(argv: list[str]) -> str:
    with pytest.raises(SlimeArgError) as e:
        _parse(argv)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ---------------------------------------------------------------- snapshots


def test_committed_router_snapshot_equals_live_parser():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_router_flags.py"), "--stdout"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    committed = (ROOT / "slime" / "backends" / "sglang" / flags.ROUTER_SNAPSHOT).read_text()
    assert out.stdout == committed, "regenerate: .venv/bin/python scripts/gen_router_flags.py"


def test_snapshots_ship_as_package_data():
    sg, rt = load_sglang_snapshot(), load_router_snapshot()
    assert (sg["version"], rt["version"]) == ("0.5.23", "0.3.2")
    assert sg["num_options"] == len(sg["options"]) > 500
    dests = {o["dest"] for o in sg["options"]}
    assert SKIPPED_SGLANG_FLAGS <= dests  # every flag slime sets exists in this SGLang


def test_every_snapshot_option_is_registered_except_skipped():
    p = _parser()
    registered = {s for a in p._actions for s in a.option_strings}
    for opt in load_sglang_snapshot()["options"]:
        names = {f"--sglang-{s.lstrip('-')}" for s in opt["option_strings"]}
        assert (names <= registered) == (opt["dest"] not in SKIPPED_SGLANG_FLAGS), opt["dest"]
    defaults = vars(p.parse_args([]))
    own = set(flags.SLIME_SGLANG_FLAGS)
    assert all(v is None for k, v in defaults.items() if k not in own), "pass-through defaults must be None"
    assert defaults["sglang_server_concurrency"] == 512
    assert defaults["sglang_router_request_timeout_secs"] == 14400


# ---------------------------------------------------------------- unknown and forbidden flags


def test_unknown_sglang_flag_one_line_with_suggestion():
    msg = _error(["--sglang-mem-fraction-statc", "0.5"])
    assert msg == (
        "unknown SGLang flag --sglang-mem-fraction-statc (not a flag of SGLang 0.5.17 or 0.5.23's ServerArgs); "
        "did you mean --sglang-mem-fraction-static? Run 'slime train --help-sglang' to list them"
    )
    assert "did you mean" not in _error(["--sglang-zzzz-qqqq=1"])
    assert "--sglang-zzzz-qqqq " in _error(["--sglang-zzzz-qqqq=1"])


@pytest.mark.parametrize(
    ("flag", "source"),
    [
        ("--sglang-tp-size", "--rollout-num-gpus-per-engine"),
        ("--sglang-tensor-parallel-size", "--rollout"),
        ("--sglang-model-path", "--hf-checkpoint"),
        ("--sglang-port", "placement"),
        ("--sglang-random-seed", "--seed"),
    ],
)
def test_flags_slime_sets_are_refused_with_their_source(flag, source):
    msg = _error([flag, "1"])
    assert msg.startswith(f"{flag} is not accepted: slime sets SGLang's") and source in msg


def test_unknown_and_forbidden_router_flags():
    assert "did you mean --router-policy?" in _error(["--router-polcy", "manual"])
    assert "--sglang-router-request-timeout-secs" in _error(["--router-request-timeout-secs", "5"])
    assert _error(["--router-port", "1"]).startswith("--router-port is not accepted")
    assert _error(["--router-worker-urls", "http://x"]).startswith("--router-worker-urls is not accepted")


def test_other_unknown_flags_are_left_to_the_caller():
    check_unknown_prefixed(["--totally-unrelated", "--sglangish"])  # not ours: no error


# ---------------------------------------------------------------- values


def test_types_and_choices_are_validated(capsys):
    for argv in (
        ["--sglang-mem-fraction-static", "lots"],
        ["--sglang-dtype", "float64"],
        ["--sglang-cuda-graph-config", "{not json"],
        ["--sglang-context-length", "1.5Ki"],
        ["--router-policy", "fastest"],
    ):
        with pytest.raises(SystemExit):
            _parser().parse_args(argv)
    err = capsys.readouterr().err
    assert "invalid float value: 'lots'" in err and "invalid choice: 'float64'" in err
    assert "not valid JSON" in err and "invalid choice: 'fastest'" in err


def test_values_aliases_and_boolean_pairs():
    args = _parse(
        [
            "--sglang-data-parallel-size", "4",
            "--sglang-ep", "2",
            "--sglang-mem-fraction-static", "0.7",
            "--sglang-dtype", "bfloat16",
            "--sglang-context-length", "32k",
            "--sglang-cuda-graph-config", '{"decode": {"backend": "full"}}',
            "--sglang-cuda-graph-bs-decode", "1", "2", "4",
            "--sglang-no-lora-strict-loading",
            "--sglang-enable-tf32-matmul",
            "--sglang-disable-radix-cache",
            "--sglang-router-ip", "10.0.0.1",
        ]
    )  # fmt: skip
    assert sglang_overrides_from_args(args) == {
        "dp_size": 4,
        "ep_size": 2,
        "mem_fraction_static": 0.7,
        "dtype": "bfloat16",
        "context_length": 32000,
        "cuda_graph_config": {"decode": {"backend": "full"}},
        "cuda_graph_bs_decode": [1, 2, 4],
        "lora_strict_loading": False,
        "enable_tf32_matmul": True,
        "disable_radix_cache": True,
    }
    assert args.sglang_router_ip == "10.0.0.1"  # slime's own: not a server override
    assert sglang_overrides_from_args(_parse([])) == {}


def test_router_pass_through_values():
    args = _parse(["--router-policy", "consistent_hashing", "--router-log-level", "warn", "--router-dp-aware"])
    assert router_overrides_from_args(args) == {"policy": "consistent_hashing", "log_level": "warn", "dp_aware": True}
    assert router_overrides_from_args(_parse([])) == {}


_SUFFIX = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


@settings(max_examples=examples(200), deadline=None)
@given(n=st.integers(min_value=0, max_value=10**6), suffix=st.sampled_from(sorted(_SUFFIX)))
def test_human_readable_int_matches_sglang_rules(n, suffix):
    assert flags._human_int(f"{n}{suffix}") == n * _SUFFIX[suffix]


# ---------------------------------------------------------------- YAML overrides


def test_validate_override_keys():
    validate_override_keys(["mem-fraction-static", "chunked_prefill_size", "model_path"], "cfg.yaml: sglang[0]")
    with pytest.raises(SlimeArgError, match=r"^cfg.yaml: sglang\[0\]: unknown SGLang server arg 'mem_fracton_static'"):
        validate_override_keys(["mem_fracton_static"], "cfg.yaml: sglang[0]")
    with pytest.raises(SlimeArgError, match="did you mean mem_fraction_static"):
        validate_override_keys(["mem_fracton_static"], "cfg.yaml")
    with pytest.raises(SlimeArgError, match="'port' is not allowed"):
        validate_override_keys(["port"], "cfg.yaml")


def test_help_lists_pass_through_flags():
    text = flags.sglang_flags_help()
    assert "--sglang-mem-fraction-static" in text and "--sglang-tp-size" not in text
