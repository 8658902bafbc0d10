"""`python -m sim.fake_sglang`: start a fake SGLang server (engines: hf | scripted | synthetic).

Prints ``fake_sglang ready http://HOST:PORT engine=E`` on stdout once it serves; SIGTERM / SIGINT abort
in-flight requests (their clients get finish_reason abort) and exit 0.

Multi-node (``--nnodes N --node-rank K --dist-init-addr HOST:PORT``, SGLang's flags): node rank 0 is the engine and
prints its ready line once every other node rank has joined; node ranks >= 1 serve nothing (multinode.py).
Every listening socket binds the host it was given (``--host``, the dist-init host), never all interfaces.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, NoReturn

from aiohttp import web

from sim.fake_sglang.launch import LISTEN_FD, run_via_zygote
from sim.fake_sglang.multinode import NodeRendezvous, parse_dist_init_addr, run_follower
from sim.fake_sglang.releases import SGLANG_VERSIONS

if TYPE_CHECKING:  # node ranks >= 1 never build an engine: they do not import torch
    from sim.fake_sglang.engine import Engine

logger = logging.getLogger(__name__)
DEFAULT_DIST_TIMEOUT_S = 300.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sim.fake_sglang", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--engine", choices=["hf", "scripted", "synthetic"], required=True)
    p.add_argument("--model-path", default=None, help="HF checkpoint dir (hf: the model; scripted: the tokenizer)")
    p.add_argument("--script", default=None, help="scripted engine rules (YAML/JSON)")
    p.add_argument("--synthetic-config", default=None, help="synthetic engine distributions (YAML/JSON)")
    p.add_argument("--request-log", default=None, help="append one JSON line per HTTP request here")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="hf: weight dtype")
    p.add_argument("--base-gpu-id", type=int, default=0, help="SGLang's: the first GPU this engine uses (cuda)")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="GPUs the engine pretends to span: ranks it takes in a weight-update group",
    )
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="SGLang's flag: the model's context length (default: from its config); longer prompts get SGLang's 400",
    )
    p.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="SGLang's flag: honour a request's sampling_seed (without it SGLang ignores the seed and so does the "
        "fake; python/sglang/srt/sampling/sampling_batch_info.py)",
    )
    p.add_argument(
        "--sglang-version",
        default=SGLANG_VERSIONS[-1],
        choices=SGLANG_VERSIONS,
        help="the SGLang release whose HTTP protocol the fake speaks (protocol.py: what differs between them)",
    )
    # SGLang's names (server_args.py): PD role and the prefill's bootstrap server port.
    p.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=None)
    p.add_argument("--disaggregation-timeout-s", type=float, default=30.0, help="decode: wait this long for prefill")
    p.add_argument("--fault", choices=["none", "hang", "slow", "error"], default="none", help="inject a fault")
    p.add_argument("--fault-delay-s", type=float, default=1.0, help="per-request delay of --fault slow")
    # SGLang's names (server_args.py): one server process per node of an engine larger than a node.
    p.add_argument("--nnodes", type=int, default=1, help="nodes the engine spans")
    p.add_argument("--node-rank", type=int, default=0, help="this process's node; 0 serves HTTP")
    p.add_argument("--dist-init-addr", default=None, help="HOST:PORT where node rank 0 gathers the other nodes")
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=None,
        help=f"seconds to wait for the other nodes (default {DEFAULT_DIST_TIMEOUT_S:.0f})",
    )
    a = p.parse_args(argv)
    if a.nnodes < 1:
        p.error(f"--nnodes must be at least 1, got {a.nnodes}")
    if not 0 <= a.node_rank < a.nnodes:
        p.error(f"--node-rank {a.node_rank} is not in [0, --nnodes {a.nnodes})")
    if a.nnodes > 1 and not a.dist_init_addr:
        p.error(f"--nnodes {a.nnodes} needs --dist-init-addr HOST:PORT (node rank 0's address)")
    if a.dist_init_addr is not None:
        try:
            parse_dist_init_addr(a.dist_init_addr)
        except ValueError as e:
            p.error(f"--dist-init-addr: {e}")
    if a.engine in ("hf", "scripted") and not a.model_path:
        p.error(f"--engine {a.engine} needs --model-path")
    if a.engine == "scripted" and not a.script:
        p.error("--engine scripted needs --script")
    if a.disaggregation_mode == "prefill" and a.disaggregation_bootstrap_port is None:
        p.error("--disaggregation-mode prefill needs --disaggregation-bootstrap-port")
    return a


def build_engine(a: argparse.Namespace) -> Engine:
    common = {
        "max_running_requests": a.max_running_requests,
        "random_seed": a.random_seed,
        "deterministic": a.enable_deterministic_inference,
    }
    if a.engine == "hf":
        from sim.fake_sglang.hf_engine import HFEngine

        return HFEngine(model_path=a.model_path, device=a.device, dtype=a.dtype, **common)
    if a.engine == "scripted":
        from sim.fake_sglang.scripted_engine import ScriptedEngine, load_script

        return ScriptedEngine(model_path=a.model_path, script=load_script(a.script), **common)
    from sim.fake_sglang.synthetic_engine import SyntheticEngine, load_config

    return SyntheticEngine(config=load_config(a.synthetic_config), **common)


async def serve(a: argparse.Namespace) -> int:
    """Node rank 0 (or a single-node engine): the HTTP server. Returns the exit code."""
    from sim.fake_sglang.info_routes import context_length, hf_config
    from sim.fake_sglang.server import STATE_KEY, build_app

    nodes = None
    if a.nnodes > 1:
        nodes = NodeRendezvous(*parse_dist_init_addr(a.dist_init_addr), a.nnodes)
        await nodes.start()
    engine = build_engine(a)
    engine.context_len = context_length(hf_config(engine, a.model_path), a.context_length)
    server_args = {
        "model_path": a.model_path,
        "tokenizer_path": a.model_path,
        "served_model_name": a.served_model_name or a.model_path or f"fake-{a.engine}",
        "context_length": a.context_length,
        "host": a.host,
        "port": a.port,
        "random_seed": a.random_seed,
        "device": a.device,
        "max_running_requests": a.max_running_requests,
        "tp_size": a.tp_size,
        "dp_size": 1,
        "enable_deterministic_inference": a.enable_deterministic_inference,
        "fake_engine": a.engine,
        "disaggregation_mode": a.disaggregation_mode,
        "disaggregation_bootstrap_port": a.disaggregation_bootstrap_port,
        "nnodes": a.nnodes,
        "node_rank": a.node_rank,
        "dist_init_addr": a.dist_init_addr,
        "sglang_version": a.sglang_version,
    }
    rooms = None
    if a.disaggregation_mode == "prefill":
        from sim.fake_sglang.disagg import PrefillRooms

        rooms = PrefillRooms(f"http://{a.host}:{a.port}")
    app = build_app(
        engine,
        server_args=server_args,
        request_log=a.request_log,
        prefill_rooms=rooms,
        pd_timeout_s=a.disaggregation_timeout_s,
        nodes=nodes,
    )
    app[STATE_KEY]["fault"] = {"mode": a.fault, "delay_s": a.fault_delay_s}
    loop_task = asyncio.create_task(engine.run())
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    inherited = os.environ.pop(LISTEN_FD, None)  # a fork of the zygote: its launcher bound the port
    if inherited is not None:
        import socket

        site: web.BaseSite = web.SockSite(runner, socket.socket(fileno=int(inherited)))
    else:
        site = web.TCPSite(runner, a.host, a.port)
    await site.start()
    boot_runner = None
    if rooms is not None:
        boot_runner = web.AppRunner(rooms.app(), access_log=None)
        await boot_runner.setup()
        await web.TCPSite(boot_runner, a.host, a.disaggregation_bootstrap_port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    code = 0
    if nodes is not None and not await _all_nodes_joined(nodes, stop, a.dist_timeout or DEFAULT_DIST_TIMEOUT_S):
        code = 1 if not stop.is_set() else 0
        stop.set()
    if not stop.is_set():
        print(f"fake_sglang ready http://{a.host}:{a.port} engine={a.engine}", flush=True)
    await stop.wait()
    logger.info("shutting down: aborting %d in-flight requests", engine.num_unfinished)
    await engine.stop()
    await asyncio.sleep(0.2)  # let handlers send their abort answers
    await runner.cleanup()
    if boot_runner is not None:
        await boot_runner.cleanup()
    if nodes is not None:
        await nodes.close()  # the other node ranks see the connection end and exit
    loop_task.cancel()
    try:
        await loop_task
    except asyncio.CancelledError:
        pass
    return code


async def _all_nodes_joined(nodes: NodeRendezvous, stop: asyncio.Event, timeout_s: float) -> bool:
    """Wait for every node rank (False on timeout, logged, or when stopped first)."""
    joined = asyncio.create_task(nodes.all_joined.wait())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([joined, stopped], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    for t in (joined, stopped):
        t.cancel()
    if nodes.all_joined.is_set():
        return True
    if not stop.is_set():
        logger.error(
            "node ranks %s did not join %s:%d within %.0fs", nodes.missing(), nodes.host, nodes.port, timeout_s
        )
    return False


def pin_gpus(base_gpu_id: int, count: int) -> None:
    """Narrow CUDA_VISIBLE_DEVICES to GPUs base_gpu_id .. base_gpu_id+count-1 before CUDA starts.

    Why: SGLang places an engine on its GPUs by `--base-gpu-id` (the launcher leaves every GPU visible); the fake
    does the same with one environment variable, so every later `cuda` in this process (the model, and the
    weight-update group's members, which run in other threads where a `set_device` would not carry over) means
    the engine's own GPU — and an engine beside a trainer on another GPU can join its NCCL group."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else None
    if ids is None:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    if base_gpu_id + count > len(ids):
        raise SystemExit(f"--base-gpu-id {base_gpu_id} with {count} GPU(s): only {len(ids)} GPU(s) visible")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[base_gpu_id : base_gpu_id + count])


def main(argv: list[str] | None = None) -> None:
    if argv is None:  # run as `python -m sim.fake_sglang`: a fork of the test session's zygote when there is one
        code = run_via_zygote(sys.argv[1:])
        if code is not None:
            sys.exit(code)
    logging.basicConfig(
        level=os.environ.get("FAKE_SGLANG_LOG_LEVEL", "WARNING"), format="%(asctime)s %(name)s %(message)s"
    )
    a = parse_args(argv)
    if a.device == "cuda":
        pin_gpus(a.base_gpu_id, a.tp_size)
    if a.node_rank > 0:
        timeout = a.dist_timeout or DEFAULT_DIST_TIMEOUT_S
        _exit(asyncio.run(run_follower(a.dist_init_addr, a.node_rank, a.nnodes, timeout)))
    _exit(asyncio.run(serve(a)))


def _exit(code: int) -> NoReturn:
    """Exit without the interpreter's teardown of torch and transformers (~2 s on a laptop, paid at every engine
    stop): the server has closed its sockets and files by now; logs and standard streams are flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
