"""aiohttp app speaking SGLang's native HTTP API (0.5.23's, or an older release's: releases.py) in front of a fake
`Engine`.

Routes and answer shapes mirror python/sglang/srt/entrypoints/http_server.py (cited per handler); bodies are read
and refused as SGLang refuses them (validation.py, contract.py), so malformed input gets SGLang's 4xx, never a 500.
Every request is appended to a JSONL log (`--request-log`) so tests can read what the engine did.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from aiohttp import web

from sim.fake_sglang import validation as v
from sim.fake_sglang.checker import register_weights_checker
from sim.fake_sglang.contract import generate_contract_error, sampling_type_error
from sim.fake_sglang.disagg import PDError, PrefillRooms, await_prefill
from sim.fake_sglang.engine import Engine
from sim.fake_sglang.info_routes import register_info_routes
from sim.fake_sglang.multinode import NodeRendezvous
from sim.fake_sglang.openai_chat import register_chat_completions
from sim.fake_sglang.protocol import BadRequest, GenRequest, build_response, normalize_generate_body
from sim.fake_sglang.releases import SGLANG_VERSIONS, has_json_contract, has_update_sessions, release
from sim.fake_sglang.validation import RequestError, read_body
from sim.fake_sglang.weight_group import register_weight_group_endpoints
from sim.fake_sglang.weights import decode

logger = logging.getLogger(__name__)

ENGINE_KEY = web.AppKey("engine", Engine)
STATE_KEY = web.AppKey("state", dict)


_error = v.error_message  # http_server.py `_create_error_response`: {"error": {"message": ...}}, 400
# Endpoints that answer while a multi-node engine still waits for nodes (SGLang serves nothing then; the fake
# answers what it is and why it is not ready).
_NODE_FREE = ("/get_server_info", "/server_info", "/get_model_info", "/model_info", "/_fault")


class RequestLog:
    """Append-only JSONL, flushed per line (tests read it while the server runs)."""

    def __init__(self, path: str | None) -> None:
        self._f = open(path, "a", buffering=1) if path else None  # noqa: SIM115 - lives as long as the server

    def write(self, rec: dict[str, Any]) -> None:
        if self._f is None:
            return
        try:
            line = json.dumps(rec, default=str)
        except (RecursionError, ValueError):  # a client's body nested too deeply to re-encode
            line = json.dumps({**rec, "body": v.short_repr(rec.get("body"))}, default=str)
        self._f.write(line + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def _summary(resp: dict[str, Any]) -> dict[str, Any]:
    m = resp["meta_info"]
    return {
        "rid": m["id"],
        "output_ids": resp["output_ids"],
        "finish_reason": m["finish_reason"],
        "weight_version": m["weight_version"],
        "prompt_tokens": m.get("prompt_tokens"),  # absent from the answer of a request aborted while waiting
        "completion_tokens": m["completion_tokens"],
    }


FAULT_MODES = ("none", "hang", "slow", "error")
_FAULT = v.Model(
    "FaultReq",
    {"mode": v.Field(v.literal(*FAULT_MODES), default="none"), "delay_s": v.Field(v.lax_float, default=0.0)},
)


def build_app(
    engine: Engine,
    *,
    server_args: dict[str, Any],
    request_log: str | None = None,
    prefill_rooms: PrefillRooms | None = None,
    pd_timeout_s: float = 30.0,
    nodes: NodeRendezvous | None = None,
) -> web.Application:
    """`prefill_rooms` set: this is a prefill engine; server_args["disaggregation_mode"] == "decode": a decode one.
    `nodes`: node rank 0 of a multi-node engine; it is not healthy while a node is missing."""
    log = RequestLog(request_log)
    version = server_args.pop("sglang_version", None) or SGLANG_VERSIONS[-1]  # not a ServerArgs field
    sessions = has_update_sessions(version)
    contract = has_json_contract(version)
    state: dict[str, Any] = {
        "server_args": server_args,
        "version": version,
        "fault": {"mode": "none", "delay_s": 0.0},
        "weight_update_session": {"open": False, "loaded": False},
    }
    mode = server_args.get("disaggregation_mode") or "null"

    def respond(req: GenRequest, sending: bool = True) -> dict[str, Any]:
        return build_response(
            req,
            engine.output_text(req),
            engine.weight_version,
            engine.token_texts(req) if req.return_text_in_logprobs else None,
            engine.token_text if req.return_text_in_logprobs else None,
            sending=sending,
        )

    @web.middleware
    async def fault_mw(request: web.Request, handler: Any) -> web.StreamResponse:
        # Fault injection for fault-tolerance tests (POST /_fault): `hang` = process alive, nothing answers
        # (health checks time out); `slow` = every /generate waits delay_s first; `error` = HTTP 503.
        fault = state["fault"]
        if request.path != "/_fault" and fault["mode"] == "hang":
            await asyncio.Event().wait()
        if request.path in ("/generate", "/health_generate") and fault["mode"] == "error":
            return _error("injected fault: engine error", status=503)
        if request.path == "/generate" and fault["mode"] == "slow":
            await asyncio.sleep(float(fault["delay_s"]))
        return await handler(request)

    @web.middleware
    async def nodes_mw(request: web.Request, handler: Any) -> web.StreamResponse:
        missing = nodes.missing() if nodes is not None else []
        if not missing or request.path in _NODE_FREE:
            return await handler(request)
        if request.path in ("/health", "/health_generate"):
            return web.Response(status=503)  # http_server.py health_generate while ServerStatus.Starting
        return _error(f"the engine is waiting for node ranks {missing} to join", status=503)

    @web.middleware
    async def errors_mw(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except RequestError as e:
            return e.response
        except BadRequest as e:
            return _error(str(e))
        except web.HTTPException as e:
            answer = v.route_error(e.status)  # FastAPI's own 404 / 405 bodies
            if answer is None:
                raise
            return answer

    @web.middleware
    async def logging_mw(request: web.Request, handler: Any) -> web.StreamResponse:
        t0 = time.time()
        request["log"] = {}
        resp = await handler(request)
        rec = {"endpoint": request.path, "method": request.method, "ts_start": t0, "ts_end": time.time()}
        rec["status"] = resp.status
        rec.update(request["log"])
        log.write(rec)
        return resp

    async def parsed(request: web.Request, model: v.Model, *, required: bool = True) -> dict[str, Any]:
        """The validated body (SGLang's 400 on failure); the client's own JSON object goes to the request log."""
        raw = await read_body(request)
        if isinstance(raw, dict):
            request["log"]["body"] = raw
        out = model.validate(raw, required=required)
        return out if out is not None else model.validate({})  # an optional body left out: the defaults

    # ---- /generate (http_server.py: generate_request; tokenizer_manager.py: generate_request) ----------
    async def generate(request: web.Request) -> web.StreamResponse:
        body = await read_body(request)
        request["log"]["body"] = body if isinstance(body, dict) else v.short_repr(body)
        v.GENERATE.validate(body)  # FastAPI's parse of GenerateReqInput
        if contract:
            error = generate_contract_error(body)  # then the JSON contract (api_contract.py, 0.5.22+)
            if error is not None:
                return v.contract_error(error)
        elif (error := sampling_type_error(body, release(version))) is not None:  # SamplingParams(**params): TypeError
            request["log"]["error"] = error
            return v.internal_server_error()
        is_batch, items = normalize_generate_body(body)  # then tokenizer_manager.py's ValueErrors
        try:
            if mode != "null":
                items = await _disaggregate(request, body, is_batch, items)
        except PDError as e:
            logger.error("PD handshake failed: %s", e)
            request["log"]["pd_error"] = str(e)
            return _error(f"disaggregation: {e}", status=500)
        reqs: list[GenRequest] = []
        try:
            for it in items:
                reqs.append(engine.submit(it))
        except BadRequest:
            for r in reqs:  # a batch is admitted whole or not at all
                engine.abort(rid=r.rid, message="batch refused")
                engine.forget(r)
            raise
        try:
            for r in reqs:
                if r.return_logprob:  # the prompt's log-probs (SGLang computes them in the prefill)
                    await engine.score_input(r)
            if body.get("stream"):
                return await _stream(request, reqs, is_batch)
            for r in reqs:
                await r.done.wait()
            outs = [respond(r) for r in reqs]
            request["log"]["responses"] = [_summary(o) for o in outs]
            return web.json_response(outs if is_batch else outs[0])
        except asyncio.CancelledError:
            # Client went away: SGLang aborts the request (tokenizer_manager.create_abort_task).
            for r in reqs:
                engine.abort(rid=r.rid, message="client disconnected")
            raise
        finally:
            for r in reqs:
                if r.finished:
                    engine.forget(r)

    async def _disaggregate(
        request: web.Request, body: dict[str, Any], is_batch: bool, items: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        if is_batch:
            raise BadRequest("batched /generate is not supported by a disaggregated fake engine")
        request["log"]["disaggregation_mode"] = mode
        request["log"]["bootstrap_room"] = body.get("bootstrap_room")
        if any(isinstance(body.get(k), list) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")):
            raise BadRequest("bootstrap_host, bootstrap_port and bootstrap_room are single values for one request")
        missing = [k for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room") if body.get(k) is None]
        if (mode == "decode" and missing) or (mode == "prefill" and "bootstrap_room" in missing):
            raise BadRequest(f"a {mode} engine needs {', '.join(missing)} (requests come through a PD router)")
        if mode == "prefill":
            assert prefill_rooms is not None
            prefill_rooms.publish(body["bootstrap_room"], body)
            # the prefill computes the prompt and the first token; decode produces the answer the client sees
            items[0]["sampling_params"] = dict(items[0].get("sampling_params") or {}, max_new_tokens=1)
            return items
        rec = await await_prefill(body, pd_timeout_s)
        request["log"]["paired_prefill"] = rec["prefill_url"]
        return items

    async def fault(request: web.Request) -> web.Response:
        body = await parsed(request, _FAULT, required=False)
        if not body["delay_s"] >= 0:
            return _error(f"delay_s must be a non-negative number, got {body['delay_s']}")
        state["fault"] = {"mode": body["mode"], "delay_s": body["delay_s"]}
        logger.warning("fault injected: %s", state["fault"])
        return web.json_response(state["fault"])

    async def _stream(request: web.Request, reqs: list[GenRequest], is_batch: bool) -> web.StreamResponse:
        # http_server.py: SSE `data: <json>\n\n` chunks, cumulative output (incremental_streaming_output=False),
        # then `data: [DONE]`. finish_reason is null in every chunk before the last of a request.
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        sent = [0] * len(reqs)
        done = [False] * len(reqs)
        while True:
            for r in reqs:
                r.changed.clear()  # clear before reading state, so no update is missed
            for i, r in enumerate(reqs):
                if not done[i] and (r.finished or len(r.output_ids) != sent[i]):
                    out = respond(r)
                    if is_batch:
                        out["index"] = i
                    await resp.write(b"data: " + json.dumps(out).encode() + b"\n\n")
                    sent[i], done[i] = len(r.output_ids), r.finished
            if all(done):
                break
            waiters = [asyncio.ensure_future(r.changed.wait()) for r, d in zip(reqs, done, strict=True) if not d]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
        await resp.write(b"data: [DONE]\n\n")
        request["log"]["responses"] = [_summary(respond(r, sending=False)) for r in reqs]
        await resp.write_eof()
        return resp

    # ---- control endpoints --------------------------------------------------------------------------
    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(request: web.Request) -> web.Response:
        # http_server.py: health_generate runs a 1-token greedy generation on input_ids [0].
        try:
            r = engine.submit(
                {
                    "rid": f"HEALTH_CHECK_{time.time()}",
                    "input_ids": [0],
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                }
            )
        except BadRequest:
            return web.Response(status=503)
        try:
            await asyncio.wait_for(_wait(r), timeout=float(state["server_args"].get("health_check_timeout", 20)))
        except TimeoutError:
            engine.abort(rid=r.rid)
            return web.Response(status=503)
        finally:
            engine.forget(r)
        return web.Response(status=200)

    async def _wait(r: GenRequest) -> None:
        await r.done.wait()

    async def abort_request(request: web.Request) -> web.Response:
        # http_server.py: abort_request(AbortReq{rid, abort_all}) -> 200 empty. tokenizer_manager.py
        # `abort_request`: an unknown rid is no error, and an empty rid without abort_all is ignored (it would
        # prefix-match every request).
        body = await parsed(request, v.ABORT)
        if body["abort_all"] or body["rid"]:
            request["log"]["aborted"] = engine.abort(rid=body["rid"], abort_all=body["abort_all"])
        return web.Response(status=200)

    async def flush_cache(request: web.Request) -> web.Response:
        # http_server.py: flush_cache(timeout: Query(0.0, ge=0.0)) -> 200, or 400 "Flush cache failed." when requests
        # are running or waiting; a Starlette Response of text without a media type (no Content-Type). With a
        # timeout the scheduler waits for idle that long (scheduler_components/flush_wrapper.py). It takes no body.
        timeout = v.non_negative_float_query(request, "timeout", 0.0)
        deadline = time.monotonic() + timeout
        ok = engine.flush_cache()
        while not ok and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            ok = engine.flush_cache()
        if ok:
            text = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
                    "requests, the operation will not be performed.)\n")  # fmt: skip
        else:
            text = "Timed out waiting for idle state." if timeout > 0 else "Flush cache failed.\n"
        return v.untyped_text(text, status=200 if ok else 400)

    async def pause_generation(request: web.Request) -> web.Response:
        # io_struct.py: PauseGenerationReqInput.mode in {abort, retract, in_place}, default abort.
        body = await parsed(request, v.PAUSE)
        await engine.pause(body["mode"])
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(request: web.Request) -> web.Response:
        await parsed(request, v.CONTINUE)
        engine.continue_generation()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _weights_common(request: web.Request, body: dict[str, Any], load: Any) -> web.Response:
        # http_server.py: update_weights_from_* -> {"success", "message"}, 200 or 400; weight_version set
        # only on success (_update_weight_version_if_provided).
        if body["abort_all_requests"]:
            engine.abort(abort_all=True)
        try:
            await load()
        except Exception as e:  # noqa: BLE001 - any failure to load (a bad pickle among them) is success=false
            logger.warning("weight update failed: %s", e)
            return web.json_response({"success": False, "message": f"Failed to update weights: {e}"}, status=400)
        # scheduler_update_weights_mixin.py: a requested flush that fails (requests still running) is an assert
        # in the scheduler, not a reply; the caller must have drained the engine first
        if body["flush_cache"] and not engine.flush_cache():
            logger.error("Cache flush failed after updating weights: %d requests unfinished", engine.num_unfinished)
            return _error("Cache flush failed after updating weights", status=500)
        message = "Succeeded to update model weights."
        if body["weight_version"] is not None:
            engine.weight_version = body["weight_version"]
            message += f" Weight version updated to {engine.weight_version}."
        return web.json_response({"success": True, "message": message})

    async def update_weights_from_tensor(request: web.Request) -> web.Response:
        body = await parsed(request, v.UPDATE_FROM_TENSOR)
        request["log"]["parsed_at"] = time.time()  # the body read and validated (the bench's timeline)
        raw = request["log"].get("body", {})
        request["log"]["body"] = {k: x for k, x in raw.items() if k != "serialized_named_tensors"}
        request["log"]["body"]["num_serialized"] = len(body["serialized_named_tensors"])
        if sessions and not state["weight_update_session"]["open"]:  # 0.5.21+: scheduler weight_updater.py
            return web.json_response(
                {"success": False, "message": "update_weights_from_tensor must run between begin_weight_update() "
                 "and end_weight_update()"}, status=400,
            )  # fmt: skip

        async def load() -> None:
            t0 = time.perf_counter()
            parts: dict[str, float] = {}
            # decoded on the event loop, not a worker thread: it takes ~1 ms (the payload carries handles, not
            # bytes), less than waking a thread and coming back costs inside a sync
            received = decode(body["serialized_named_tensors"], body["load_format"], parts)
            t1 = time.perf_counter()
            request["log"]["tensor_names"] = received.names
            await engine.load_received(received)
            # where an update's time goes on this side (the weight-sync bench reads it from the request log)
            request["log"]["decode_s"], request["log"]["load_s"] = t1 - t0, time.perf_counter() - t1
            request["log"]["unpickle_s"], request["log"]["views_s"] = parts["unpickle"], parts["views"]

        return await _weights_common(request, body, load)

    async def update_weights_from_disk(request: web.Request) -> web.Response:
        body = await parsed(request, v.UPDATE_FROM_DISK)

        async def load() -> None:
            if not body["model_path"]:
                raise ValueError("model_path is empty")
            await engine.load_from_disk(body["model_path"])
            state["server_args"]["model_path"] = body["model_path"]

        resp = await _weights_common(request, body, load)
        # UpdateWeightFromDiskReqOutput also carries num_paused_requests.
        data = json.loads(resp.text)
        data["num_paused_requests"] = 0
        return web.json_response(data, status=resp.status)

    async def update_weight_version(request: web.Request) -> web.Response:
        # io_struct.py UpdateWeightVersionReqInput: new_version required; abort_all_requests defaults to True.
        body = await parsed(request, v.UPDATE_WEIGHT_VERSION)
        if body["abort_all_requests"]:
            engine.abort(abort_all=True)
        engine.weight_version = body["new_version"]
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {engine.weight_version}",
             "new_version": engine.weight_version}
        )  # fmt: skip

    async def release_memory(request: web.Request) -> web.Response:
        # http_server.py: release_memory_occupation(ReleaseMemoryOccupationReqInput{tags}) returns None, which
        # FastAPI answers as JSON `null` (recorded from 0.5.17); a failure is `_create_error_response`.
        body = await parsed(request, v.RELEASE_MEMORY)
        engine.release(body["tags"])
        return web.json_response(None)

    async def resume_memory(request: web.Request) -> web.Response:
        body = await parsed(request, v.RESUME_MEMORY)
        engine.resume(body["tags"])
        return web.json_response(None)

    app = web.Application(middlewares=[fault_mw, logging_mw, nodes_mw, errors_mw], client_max_size=1 << 30)
    app[ENGINE_KEY] = engine
    app[STATE_KEY] = state
    r = app.router
    r.add_route("POST", "/generate", generate)
    r.add_route("PUT", "/generate", generate)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    register_info_routes(app, engine, state)  # /model_info, /server_info, /v1/models, /get_weights_by_name, ...
    r.add_post("/abort_request", abort_request)
    r.add_get("/flush_cache", flush_cache)
    r.add_post("/flush_cache", flush_cache)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/update_weight_version", update_weight_version)
    # /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group and the
    # /begin_weight_update … /end_weight_update session (weight_group.py)
    register_weight_group_endpoints(app, engine, state, int(server_args.get("tp_size") or 1), server_args.get("host"))
    for path, handler in (
        ("/release_memory_occupation", release_memory),
        ("/resume_memory_occupation", resume_memory),
    ):
        r.add_get(path, handler)
        r.add_post(path, handler)
    r.add_post("/_fault", fault)
    register_weights_checker(
        app, engine, skip_list=sessions
    )  # GET/POST /weights_checker (http_server.py: check_weights)
    # POST /v1/chat/completions (serving_chat.py): generative reward models are asked through it
    register_chat_completions(app, engine, str(server_args.get("served_model_name") or "default"), version)

    async def on_cleanup(_app: web.Application) -> None:
        log.close()

    app.on_cleanup.append(on_cleanup)
    return app
