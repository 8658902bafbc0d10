"""`POST /v1/chat/completions` on the fake server: what a generative reward model (an LLM judge) is asked.

SGLang serves the OpenAI chat API next to its native one (python/sglang/srt/entrypoints/openai/serving_chat.py):
the messages go through the model's chat template, the prompt is generated like any `/generate` request, and the
answer is a `ChatCompletionResponse` (python/sglang/srt/entrypoints/openai/protocol.py): `id`, `object:
"chat.completion"`, `created`, `model`, `choices[{index, message{role, content, reasoning_content, tool_calls},
logprobs, finish_reason, matched_stop}]`, `usage{prompt_tokens, completion_tokens, total_tokens}`, `metadata
{weight_version}`. The fake serves the non-streaming, n=1 form — what a judge call needs — and refuses the rest
with SGLang's error shape (`{"object": "error", "message", "type": "BadRequest", "code": 400}`).
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from sim.fake_sglang.engine import Engine
from sim.fake_sglang.protocol import BadRequest, new_rid
from sim.fake_sglang.releases import SGLANG_VERSIONS, chat_drops_empty_tool_calls, chat_has_completion_tokens_details
from sim.fake_sglang.validation import read_body

# protocol.py ChatCompletionRequest: sampling fields read by the fake, with their OpenAI names
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens")


def _openai_error(message: str, status: int = 400) -> web.Response:
    body = {"object": "error", "message": message, "type": "BadRequest", "param": None, "code": status}
    return web.json_response(body, status=status)


def chat_to_generate_item(engine: Engine, body: Any) -> dict[str, Any]:
    """The `/generate` item a chat request stands for (serving_chat.py `_process_messages` + sampling params)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    if body.get("stream"):
        raise BadRequest("fake_sglang: /v1/chat/completions serves stream=false only")
    if (body.get("n") or 1) != 1:
        raise BadRequest("fake_sglang supports n=1 only")
    if engine.tokenizer is None:
        raise BadRequest("this engine has no tokenizer to apply a chat template with")
    prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    params: dict[str, Any] = {k: body[k] for k in _SAMPLING if body.get(k) is not None}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    if body.get("seed") is not None:
        params["sampling_seed"] = body["seed"]
    return {"input_ids": engine.encode(prompt), "rid": f"chatcmpl-{new_rid()}", "sampling_params": params}


def register_chat_completions(
    app: web.Application, engine: Engine, served_model_name: str, version: str = SGLANG_VERSIONS[-1]
) -> None:
    async def chat_completions(request: web.Request) -> web.Response:
        body = await read_body(request)
        if isinstance(body, dict):
            request["log"]["body"] = body
        try:
            req = engine.submit(chat_to_generate_item(engine, body))
        except BadRequest as e:
            return _openai_error(str(e))
        try:
            await req.done.wait()
        finally:
            engine.forget(req)
        finish = req.finish_reason or {}
        if finish.get("type") == "abort":
            return _openai_error(f"request aborted: {finish.get('message')}", status=503)
        text = engine.output_text(req)
        request["log"]["responses"] = [{"rid": req.rid, "output_ids": req.output_ids, "finish_reason": finish}]
        n_in, n_out = len(req.prompt_ids), len(req.output_ids)
        message: dict[str, Any] = {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None}
        if chat_drops_empty_tool_calls(version):
            del message["tool_calls"]
        # protocol.py UsageInfo: prompt_tokens_details only with --enable-cache-report, reasoning_tokens 0 without a
        # reasoning parser (recorded from 0.5.17); 0.5.23 adds completion_tokens_details (null without reasoning)
        usage: dict[str, Any] = {"prompt_tokens": n_in, "total_tokens": n_in + n_out, "completion_tokens": n_out,
                                 "prompt_tokens_details": None, "reasoning_tokens": 0}  # fmt: skip
        if chat_has_completion_tokens_details(version):
            usage["completion_tokens_details"] = None
        answer = {
            "id": req.rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or served_model_name,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": finish.get("type"),
                    "matched_stop": finish.get("matched"),
                }
            ],
            "usage": usage,
            "metadata": {"weight_version": engine.weight_version},
        }
        return web.json_response(answer)

    app.router.add_post("/v1/chat/completions", chat_completions)
