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
    p.add_argument("--served-model-name", default=None)
    a = p.parse_args(argv)
    if a.engine in ("hf", "scripted") and not a.model_path:
        p.error(f"--engine {a.engine} needs --model-path")
    if a.engine == "scripted" and not a.script:
        p.error("--engine scripted needs --script")
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
        "tp_size": 1,
        "dp_size": 1,
        "fake_engine": a.engine,
    }
    app = build_app(engine, server_args=server_args, request_log=a.request_log)
    loop_task = asyncio.create_task(engine.run())
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, a.host, a.port)
    await site.start()
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
