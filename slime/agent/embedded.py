"""A gateway living inside the rollout process, on the loop that runs the rollout's generate functions.

Harnesses call `get_embedded_gateway(args)` from their async generate function: the first call starts one
gateway on that event loop (one per loop, so its aiohttp objects never cross loops) in front of the rollout
router, and later calls reuse it.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

from slime.agent.gateway import Gateway

logger = logging.getLogger(__name__)

_gateways: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Gateway] = weakref.WeakKeyDictionary()
_start_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()


async def get_embedded_gateway(args: Any) -> Gateway:
    from slime.rollout.dataset import load_tokenizer
    from slime.rollout.generate import get_model_url

    loop = asyncio.get_running_loop()
    lock = _start_locks.setdefault(loop, asyncio.Lock())
    async with lock:
        gw = _gateways.get(loop)
        if gw is None:
            aux = args.agent_aux_model
            gw = Gateway(
                load_tokenizer(args.hf_checkpoint),
                get_model_url(args, endpoint=""),
                store=args.agent_store,
                model_name=args.agent_model_name,
                default_max_new_tokens=args.rollout_max_response_len,
                aux_models=[aux] if aux else [],
                # what the engines were started with; else the router cannot say, and the checkpoint's config
                # gives what SGLang derives by default
                context_length=args.sglang_context_length,
            )
            await gw.start(args.agent_gateway_host, args.agent_gateway_port)
            _gateways[loop] = gw
    return gw


async def stop_embedded_gateway() -> None:
    """Stop the running loop's gateway (tests, shutdown)."""
    gw = _gateways.pop(asyncio.get_running_loop(), None)
    if gw is not None:
        await gw.stop()
