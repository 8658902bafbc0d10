"""`slime gateway`: run the agent gateway as its own process (sessions are opened through the admin API)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slime gateway", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--engine-url", required=True, help="SGLang engine or router URL (serves /generate)")
    p.add_argument("--hf-checkpoint", required=True, help="model dir whose tokenizer and chat template are used")
    p.add_argument("--admin-token", default=os.environ.get("SLIME_GATEWAY_ADMIN_TOKEN"))
    p.add_argument("--model-name", default="slime-policy", help="model id listed by GET /v1/models")
    p.add_argument("--max-new-tokens", type=int, default=4096, help="cap when neither session nor client sets one")
    p.add_argument("--max-body-mb", type=int, default=64)
    p.add_argument("--public-url", default=None, help="URL clients reach the gateway at (default http://HOST:PORT)")
    p.add_argument(
        "--store",
        default=os.environ.get("SLIME_AGENT_STORE", "memory"),
        help="session store: memory, or redis://HOST:PORT/DB to serve sessions together with other gateway processes",
    )
    p.add_argument("--aux-model", action="append", default=[], help="model name served but never trained (repeat)")
    p.add_argument("--request-log", default=None, help="append every API request (credentials masked) to this JSONL")
    p.add_argument(
        "--context-length",
        type=int,
        default=0,
        help="prompt limit in tokens (longer prompts get 400); 0: the served model's (the engine's /v1/models, "
        "else the checkpoint's config)",
    )
    p.add_argument(
        "--prepare-workers",
        type=int,
        default=2,
        help="processes per lane (bodies over 64 KiB; over 4 MiB, idle-class) that parse and render request bodies "
        "off the event loop (0: all on the loop)",
    )
    p.add_argument(
        "--body-timeout", type=float, default=60.0, help="seconds to receive a request body before answering 408"
    )
    p.add_argument(
        "--max-session-requests",
        type=int,
        default=16,
        help="requests of one session in flight at once in this process; more get 429",
    )
    return p


async def _serve(a: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from slime.agent.gateway import Gateway

    tok = AutoTokenizer.from_pretrained(a.hf_checkpoint)
    gw = Gateway(
        tok,
        a.engine_url,
        admin_token=a.admin_token,
        model_name=a.model_name,
        max_body_bytes=a.max_body_mb << 20,
        default_max_new_tokens=a.max_new_tokens,
        public_url=a.public_url,
        store=a.store,
        aux_models=a.aux_model,
        request_log=a.request_log,
        context_length=a.context_length or None,
        prepare_workers=a.prepare_workers,
        body_timeout_s=a.body_timeout,
        max_session_requests=a.max_session_requests,
    )
    url = await gw.start(a.host, a.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"slime gateway ready {url}", flush=True)
    try:
        await stop.wait()
    finally:
        await gw.stop()


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    if not a.admin_token:
        logger.warning("no --admin-token: the admin API is disabled, so no session can be opened over HTTP")
    logging.basicConfig(level=os.environ.get("SLIME_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(message)s")
    asyncio.run(_serve(a))
    return 0
