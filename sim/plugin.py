"""The simulator as slime sees it: two plugins registered in this distribution's metadata (pyproject.toml).

- ``slime.rollout_engines: sim`` — `FakeSGLangServers`: `python -m sim.fake_sglang` servers (`hf`, `scripted`,
  `synthetic` engines) behind `--rollout-engine sim`, and the stand-in `--rollout-engine auto` takes on a machine
  without CUDA. Its flags (`--sim-*`) and a `--sglang-config` model's `sim:` block are its own.
- ``slime.cpu_shims: sim`` — `sim.fake_megatron.cpu_shim:apply`, megatron-core on CPU over gloo, for
  `--custom-megatron-init-path`.

slime imports neither by name (`slime/backends/sglang/server_plugins.py` finds them), which is also what proves a
third-party engine or shim can enter the same way.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from slime.backends.sglang.server_plugins import ServerSpec
from slime.utils.cuda import cuda_available
from slime.utils.errors import SlimeArgError

ENGINES = ("hf", "scripted", "synthetic")


class FakeSGLangServers:
    name = "sim"
    stands_in_without_cuda = True
    model_keys = {"engine": "sim_engine", "script": "sim_script", "synthetic_config": "sim_synthetic_config"}
    path_keys = frozenset({"script", "synthetic_config"})

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("simulated servers (--rollout-engine sim; the sim plugin)")
        g.add_argument("--sim-engine", choices=ENGINES, default="hf", help="fake engine kind")
        g.add_argument("--sim-script", default=None, help="rules file for --sim-engine scripted")
        g.add_argument("--sim-synthetic-config", default=None, help="distribution file for --sim-engine synthetic")
        g.add_argument("--sim-request-log-dir", default=None, help="fake engines write request logs here")

    def validate(self, args: argparse.Namespace) -> None:
        for name in ("sim_script", "sim_synthetic_config"):
            path = vars(args)[name]
            if path is not None and not os.path.isfile(path):
                raise SlimeArgError(f"--{name.replace('_', '-')}: file not found: {path}")
        if args.rollout_engine == self.name and args.sim_engine == "scripted" and args.sim_script is None:
            raise SlimeArgError("--sim-engine scripted needs --sim-script FILE (rules)")

    def check_model_block(self, block: dict[str, Any]) -> str | None:
        engine = block.get("engine", "hf")
        return None if engine in ENGINES else f"unknown fake engine {engine!r}; expected hf, scripted or synthetic"

    def server_argv(self, args: argparse.Namespace, spec: ServerSpec) -> list[str]:
        """The CLI of sim/fake_sglang; `--tp-size` makes a k-GPU fake join weight-sync groups as k ranks, and a
        multi-node fake serves as one engine from node rank 0 (the others join it as SGLang's nodes do)."""
        engine = args.sim_engine
        argv = [sys.executable, "-m", "sim.fake_sglang", "--host", spec.host, "--port", str(spec.port)]
        argv += ["--engine", engine, "--model-path", str(spec.model_path), "--random-seed", str(args.seed + spec.rank)]
        if engine == "scripted":
            argv += ["--script", str(args.sim_script)]
        if engine == "synthetic":
            argv += ["--synthetic-config", str(args.sim_synthetic_config)]
        if args.sim_request_log_dir:
            argv += ["--request-log", os.path.join(args.sim_request_log_dir, f"engine_{spec.rank}.jsonl")]
        dtype = args.sglang_dtype if args.sglang_dtype not in (None, "auto") else ("bfloat16" if args.bf16 else None)
        if engine == "hf" and dtype is not None:  # the weights' dtype, as SGLang's --dtype: a bf16 sync is exact
            argv += ["--dtype", dtype]
        if cuda_available():  # SGLang's placement flag: the engine's first GPU (see Engine.base_gpu_id)
            argv += ["--device", "cuda", "--base-gpu-id", str(spec.base_gpu_id)]
        else:
            argv += ["--device", "cpu"]
        if args.sglang_max_running_requests:  # the one scheduler limit the fake shares with SGLang
            argv += ["--max-running-requests", str(args.sglang_max_running_requests)]
        if args.sglang_enable_deterministic_inference:  # only then does SGLang honour sampling_seed
            argv += ["--enable-deterministic-inference"]
        if spec.num_gpus > 1:
            argv += ["--tp-size", str(spec.num_gpus)]
        if spec.worker_type in ("prefill", "decode"):
            argv += ["--disaggregation-mode", spec.worker_type]
            if spec.bootstrap_port is not None:
                argv += ["--disaggregation-bootstrap-port", str(spec.bootstrap_port)]
        if spec.nnodes > 1:
            argv += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank)]
            argv += ["--dist-init-addr", str(spec.dist_init_addr)]
        return argv
