"""`python -m sim.fake_sglang`: start a fake SGLang server (engines: hf | scripted | synthetic).

Prints ``fake_sglang ready http://HOST:PORT engine=E`` on stdout once it serves; SIGTERM / SIGINT abort
in-flight requests (their clients get finish_reason abort) and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from aiohttp import web

logger = logging.getLogger("sim.fake_sglang")


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
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="GPUs the engine pretends to span: ranks it takes in a weight-update group",
    )
    p.add_argument("--served-model-name", default=None)
    # SGLang's names (server_args.py): PD role and the prefill's bootstrap server port.
    p.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=None)
    p.add_argument("--disaggregation-timeout-s", type=float, default=30.0, help="decode: wait this long for prefill")
    p.add_argument("--fault", choices=["none", "hang", "slow", "error"], default="none", help="inject a fault")
    p.add_argument("--fault-delay-s", type=float, default=1.0, help="per-request delay of --fault slow")
    a = p.parse_args(argv)
    if a.engine in ("hf", "scripted") and not a.model_path:
        p.error(f"--engine {a.engine} needs --model-path")
    if a.engine == "scripted" and not a.script:
        p.error("--engine scripted needs --script")
    if a.disaggregation_mode == "prefill" and a.disaggregation_bootstrap_port is None:
        p.error("--disaggregation-mode prefill needs --disaggregation-bootstrap-port")
    return a


def build_engine(a: argparse.Namespace):
    common = {"max_running_requests": a.max_running_requests, "random_seed": a.random_seed}
    if a.engine == "hf":
        from sim.fake_sglang.hf_engine import HFEngine

        return HFEngine(model_path=a.model_path, device=a.device, **common)
    if a.engine == "scripted":
        from sim.fake_sglang.scripted_engine import ScriptedEngine, load_script

        return ScriptedEngine(model_path=a.model_path, script=load_script(a.script), **common)
    from sim.fake_sglang.synthetic_engine import SyntheticEngine, load_config

    return SyntheticEngine(config=load_config(a.synthetic_config), **common)


async def serve(a: argparse.Namespace) -> None:
    from sim.fake_sglang.server import build_app

    engine = build_engine(a)
    server_args = {
        "model_path": a.model_path,
        "tokenizer_path": a.model_path,
        "served_model_name": a.served_model_name or a.model_path or f"fake-{a.engine}",
        "host": a.host,
        "port": a.port,
        "random_seed": a.random_seed,
        "device": a.device,
        "max_running_requests": a.max_running_requests,
        "tp_size": a.tp_size,
        "dp_size": 1,
        "fake_engine": a.engine,
        "disaggregation_mode": a.disaggregation_mode,
        "disaggregation_bootstrap_port": a.disaggregation_bootstrap_port,
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
    )
    from sim.fake_sglang.server import STATE_KEY

    app[STATE_KEY]["fault"] = {"mode": a.fault, "delay_s": a.fault_delay_s}
    loop_task = asyncio.create_task(engine.run())
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
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
    print(f"fake_sglang ready http://{a.host}:{a.port} engine={a.engine}", flush=True)
    await stop.wait()
    logger.info("shutting down: aborting %d in-flight requests", engine.num_unfinished)
    await engine.stop()
    await asyncio.sleep(0.2)  # let handlers send their abort answers
    await runner.cleanup()
    if boot_runner is not None:
        await boot_runner.cleanup()
    loop_task.cancel()
    try:
        await loop_task
    except asyncio.CancelledError:
        pass


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(
        level=os.environ.get("FAKE_SGLANG_LOG_LEVEL", "WARNING"), format="%(asctime)s %(name)s %(message)s"
    )
    a = parse_args(argv)
    asyncio.run(serve(a))
    sys.exit(0)


if __name__ == "__main__":
    main()
