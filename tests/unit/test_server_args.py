"""The server argv slime builds: shape checks here, and SGLang 0.5.23's own parser (`ServerArgs.add_cli_args` +
`from_cli_args`, in the side venv) reading back the fields for regular, prefill and decode engines."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from slime.arguments import build_parser, default_args
from slime.backends.sglang import flags
from slime.backends.sglang.server_args import build_server_argv
from slime.utils.errors import SlimeArgError
from tests.side_venv import side_venv_python

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]


USER_FLAGS = [
    "--sglang-mem-fraction-static", "0.5",
    "--sglang-dp-size", "2",
    "--sglang-context-length", "4k",
    "--sglang-cuda-graph-bs-decode", "1", "2", "4",
    "--sglang-cuda-graph-config", '{"decode": {"backend": "full"}}',
    "--sglang-no-lora-strict-loading",
    "--sglang-enable-tf32-matmul",
    "--sglang-disable-radix-cache",
]  # fmt: skip


def server_args(argv: Sequence[str] = (), **kw: Any) -> argparse.Namespace:
    """The real parser's defaults plus the user's `--sglang-*` flags (typed by that parser), unvalidated.

    `offload_rollout` is set as validation would leave it (the parser's default is None)."""
    parsed = vars(build_parser().parse_args(list(argv)))
    return default_args(**{**parsed, "hf_checkpoint": "/ckpt/qwen", "offload_rollout": True, **kw})


def _opt(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_regular_engine_argv():
    argv = build_server_argv(
        server_args(USER_FLAGS), backend="sglang", host="127.0.0.1", port=30000, num_gpus=4, rank=3, nccl_port=31000
    )
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert _opt(argv, "--model-path") == "/ckpt/qwen"
    assert _opt(argv, "--random-seed") == "1237"
    assert _opt(argv, "--tp-size") == "4"
    assert (_opt(argv, "--host"), _opt(argv, "--port"), _opt(argv, "--nccl-port")) == ("127.0.0.1", "30000", "31000")
    assert {"--trust-remote-code", "--enable-memory-saver", "--skip-server-warmup"} <= set(argv)
    assert "--disaggregation-mode" not in argv and "--dist-init-addr" not in argv
    i = argv.index("--cuda-graph-bs-decode")
    assert argv[i + 1 : i + 4] == ["1", "2", "4"]
    assert _opt(argv, "--cuda-graph-config") == '{"decode": {"backend": "full"}}'
    assert _opt(argv, "--context-length") == "4000"
    assert "--no-lora-strict-loading" in argv and "--enable-tf32-matmul" in argv
    # each dest rendered once
    flags = [t for t in argv if t.startswith("--")]
    assert len(flags) == len(set(flags))


def test_overrides_win_and_dash_keys_are_normalised():
    args = server_args(USER_FLAGS, offload_rollout=False)
    argv = build_server_argv(
        args,
        backend="sglang",
        host="h",
        port=1,
        overrides={"mem-fraction-static": 0.8, "model_path": "/ckpt/ref", "enable_tf32_matmul": False, "pp_size": 2},
        num_gpus=4,
    )
    assert _opt(argv, "--mem-fraction-static") == "0.8"
    assert _opt(argv, "--model-path") == "/ckpt/ref"
    assert "--no-enable-tf32-matmul" in argv and "--enable-tf32-matmul" not in argv
    assert (_opt(argv, "--pp-size"), _opt(argv, "--tp-size")) == ("2", "2")
    assert "--enable-memory-saver" not in argv


def test_multi_node_engine_and_worker_types():
    args = server_args()
    argv = build_server_argv(
        args, backend="sglang", host="h", port=1, num_gpus=16, rank=5, nnodes=2, node_rank=1,
        dist_init_addr="10.0.0.1:5000",
    )  # fmt: skip
    assert (_opt(argv, "--nnodes"), _opt(argv, "--node-rank"), _opt(argv, "--tp-size")) == ("2", "1", "16")
    assert _opt(argv, "--dist-init-addr") == "10.0.0.1:5000"
    with pytest.raises(ValueError, match="dist_init_addr"):  # node rank 0's address is required across nodes
        build_server_argv(args, backend="sglang", host="h", port=1, num_gpus=16, nnodes=2, node_rank=1)
    with pytest.raises(SlimeArgError, match="bootstrap_port"):
        build_server_argv(args, backend="sglang", host="h", port=1, worker_type="prefill")
    with pytest.raises(SlimeArgError, match="placeholder"):
        build_server_argv(args, backend="sglang", host="h", port=1, worker_type="placeholder")
    with pytest.raises(SlimeArgError, match="does not divide"):
        build_server_argv(args, backend="sglang", host="h", port=1, num_gpus=3, overrides={"pp_size": 2})


def test_sim_argv():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = server_args(
        sim_engine="scripted", sim_script="rules.yaml", sim_synthetic_config=None, sim_request_log_dir="/logs"
    )
    argv = build_server_argv(args, backend="sim", host="127.0.0.1", port=4000, rank=2, model_path="/ckpt/x")
    assert argv == [
        sys.executable, "-m", "sim.fake_sglang", "--host", "127.0.0.1", "--port", "4000", "--engine", "scripted",
        "--model-path", "/ckpt/x", "--random-seed", "1236", "--script", "rules.yaml",
        "--request-log", "/logs/engine_2.jsonl", "--device", device, *(["--base-gpu-id", "0"] if device == "cuda" else []),
    ]  # fmt: skip
    args = server_args(
        sim_engine="synthetic", sim_script=None, sim_synthetic_config="lat.json", sim_request_log_dir=None
    )
    argv = build_server_argv(args, backend="sim", host="127.0.0.1", port=4000)
    assert argv[argv.index("--engine") + 1] == "synthetic" and _opt(argv, "--synthetic-config") == "lat.json"
    assert _opt(argv, "--model-path") == "/ckpt/qwen" and "--request-log" not in argv and "--script" not in argv
    assert "--max-running-requests" not in argv  # unset: the fake's own default
    args.sglang_max_running_requests = 1024  # the one scheduler limit the fake shares with SGLang
    argv = build_server_argv(args, backend="sim", host="127.0.0.1", port=4000)
    assert _opt(argv, "--max-running-requests") == "1024"


# ---------------------------------------------------------------- SGLang's own parser (side venv)


@pytest.fixture(scope="module")
def parsed_by_sglang():
    py = side_venv_python()
    args = server_args(USER_FLAGS)
    common = dict(backend="sglang", host="127.0.0.1", num_gpus=2)
    cases = {
        "regular": build_server_argv(args, port=30000, rank=3, nccl_port=31000, **common),
        "prefill": build_server_argv(
            args,
            port=30010,
            worker_type="prefill",
            bootstrap_port=8998,
            overrides={"mem-fraction-static": 0.7, "chunked_prefill_size": 4096, "model_path": "/ckpt/other"},
            **common,
        ),
        "decode": build_server_argv(args, port=30020, worker_type="decode", overrides={"dp_size": 1}, **common),
    }
    out = subprocess.run(
        [py, str(ROOT / "tests" / "sglang_venv" / "parse_server_argv.py"), "--with-snapshot"],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    snapshot = result.pop("__snapshot__")
    for name, r in result.items():
        assert "error" not in r and "from_cli_args_error" not in r, (name, r)
    return {"__snapshot__": snapshot, **{name: r["fields"] for name, r in result.items()}}


def test_committed_sglang_snapshot_equals_live_parser(parsed_by_sglang):
    """The committed flag snapshot is what `scripts/gen_sglang_flags.py --stdout` prints from the live SGLang (run
    in the same side-venv process as the parses below: SGLang's import is most of either)."""
    live = parsed_by_sglang["__snapshot__"]
    committed = (ROOT / "slime" / "backends" / "sglang" / flags.SGLANG_SNAPSHOT).read_text()
    assert json.loads(live)["version"] == flags.SGLANG_VERSION
    assert live == committed, "regenerate: .venv-sglang/bin/python scripts/gen_sglang_flags.py"


def test_sglang_parses_regular_engine(parsed_by_sglang):
    f = parsed_by_sglang["regular"]
    assert (f["model_path"], f["tp_size"], f["random_seed"], f["port"], f["nccl_port"]) == (
        "/ckpt/qwen", 2, 1237, 30000, 31000
    )  # fmt: skip
    assert f["trust_remote_code"] and f["enable_memory_saver"] and f["skip_server_warmup"]
    assert (f["nnodes"], f["node_rank"], f["base_gpu_id"], f["gpu_id_step"]) == (1, 0, 0, 1)
    assert f["disaggregation_mode"] == "null"
    # user flags, with SGLang's own types
    assert (f["mem_fraction_static"], f["dp_size"], f["context_length"]) == (0.5, 2, 4000)
    assert f["cuda_graph_bs_decode"] == [1, 2, 4]
    assert f["cuda_graph_config"] == {"decode": {"backend": "full"}}
    assert f["lora_strict_loading"] is False and f["enable_tf32_matmul"] is True and f["disable_radix_cache"] is True


def test_sglang_parses_prefill_engine(parsed_by_sglang):
    f = parsed_by_sglang["prefill"]
    assert (f["disaggregation_mode"], f["disaggregation_bootstrap_port"]) == ("prefill", 8998)
    assert f["load_balance_method"] == "follow_bootstrap_room"
    assert (f["mem_fraction_static"], f["chunked_prefill_size"], f["model_path"]) == (0.7, 4096, "/ckpt/other")


def test_sglang_parses_decode_engine(parsed_by_sglang):
    f = parsed_by_sglang["decode"]
    assert f["disaggregation_mode"] == "decode"
    assert (f["dp_size"], f["mem_fraction_static"], f["port"]) == (1, 0.5, 30020)
