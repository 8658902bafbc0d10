"""The recorder's cases: the fixed, ordered requests `scripts/record_sglang_conformance.py` sends to one server.

Each case names why it exists, its steps (a background step runs in a thread while the next ones go), which JSON
paths must match exactly on replay (`deterministic`) and which relations must hold (`invariants`); the format is
sim/fake_sglang/conformance.py's. Requests follow SGLang's own source (python/sglang/srt/entrypoints/http_server.py
routes, python/sglang/srt/managers/io_struct.py bodies) and assume the toy model of examples/toy/prepare.py.
"""

from __future__ import annotations

from typing import Any

REQUEST_TIMEOUT_S = 20.0
BACKGROUND_TIMEOUT_S = 40.0
RUN_DEADLINE_S = 85.0
START_DELAY_S = 0.5  # a background generation is decoding by then (its first tokens come within ~0.1 s)
VOCAB_GUESS = 512  # the toy model's vocabulary is below this (sim/tiny_checkpoint.py MAX_VOCAB)
LONG_TOKENS = 3000  # a background generation: running for seconds on any device, within the toy's 4096 context
PROMPT = "Reverse the digits: 4817263"
PROMPT_IDS = [5, 17, 42, 99, 7, 23]


# ---- case building ----------------------------------------------------------------------------------------------
def req(method: str, path: str, body: Any = None, *, raw_body: str | None = None, query: dict | None = None) -> dict:
    r: dict[str, Any] = {"method": method, "path": path, "query": query or {}}
    if raw_body is not None:
        r["raw_body"] = raw_body
    elif body is not None:
        r["body"] = body
    return r


def step(name: str, request: dict, *, background: bool = False, delay_s: float = 0.0, timeout_s: float | None = None):
    t = timeout_s or (BACKGROUND_TIMEOUT_S if background else REQUEST_TIMEOUT_S)
    return {"name": name, "request": request, "background": background, "delay_s": delay_s, "timeout_s": t}


def case(name: str, why: str, steps: list[dict], deterministic: list[str] | None = None, **extra: Any) -> dict:
    """A case: its steps run in order (background ones in a thread, answered at the end), `main` the one shown."""
    main = extra.pop("main", steps[0]["name"])
    det = [f"{s['name']}.response.status" for s in steps] + list(deterministic or [])
    return {"case": name, "why": why, "main": main, "steps": steps, "deterministic": det, **extra}


def single(name: str, why: str, request: dict, deterministic: list[str] | None = None, **extra: Any) -> dict:
    return case(name, why, [step("main", request)], deterministic, **extra)


def gen_body(max_new_tokens: int = 8, *, text: str | None = None, **kw: Any) -> dict:
    """A greedy `/generate` body that runs exactly max_new_tokens (ignore_eos), token ids in unless `text`."""
    sp = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    sp.update(kw.pop("sampling_params", {}))
    prompt = {"text": text} if text is not None else {"input_ids": list(PROMPT_IDS)}
    return {**prompt, "sampling_params": sp, **kw}


def long_body(rid: str, max_new_tokens: int = LONG_TOKENS) -> dict:
    return gen_body(max_new_tokens, rid=rid)


LENGTH = [
    "response.json.meta_info.finish_reason.type",
    "response.json.meta_info.completion_tokens",
    "len(response.json.output_ids)",
]
ABORTED = ["background.response.json.meta_info.finish_reason.type"]
TOKENS_SO_FAR = [{"equal": ["len(background.response.json.output_ids)", "background.response.json.meta_info.completion_tokens"]}]  # fmt: skip


def serving_cases(vocab_size: int) -> list[dict]:
    """Identity, generation and malformed requests: nothing in flight, nothing changed on the server."""
    return [
        # ---- info --------------------------------------------------------------------------------------------
        single(
            "server_info",
            "version, server args and internal states (slime reads version, tp_size)",
            req("GET", "/server_info"),
            ["response.json.version"],
            shape_ignore=["response.json"],
            required=[
                "response.json.version",
                "response.json.tp_size",
                "response.json.dp_size",
                "response.json.model_path",
                "response.json.internal_states",
            ],
        ),
        single(
            "get_server_info",
            "the deprecated alias",
            req("GET", "/get_server_info"),
            ["response.json.version"],
            shape_ignore=["response.json"],
            required=["response.json.version", "response.json.internal_states"],
        ),
        single(
            "model_info",
            "model_path, is_generation, weight_version",
            req("GET", "/model_info"),
            [
                "response.json.is_generation",
                "response.json.weight_version",
                "response.json.model_type",
                "response.json.architectures",
            ],
        ),
        single(
            "get_model_info", "the deprecated alias", req("GET", "/get_model_info"), ["response.json.is_generation"]
        ),
        single("health", "liveness", req("GET", "/health"), ["response.text"]),
        single("health_generate", "a one-token generation", req("GET", "/health_generate"), ["response.text"]),
        single(
            "get_weight_version",
            "0.5.17: a 404 pointing to /model_info",
            req("GET", "/get_weight_version"),
            ["response.json"],
        ),
        single(
            "begin_weight_update",
            "absent before 0.5.19: 404",
            req("POST", "/begin_weight_update", {}),
            ["response.json"],
        ),
        single(
            "end_weight_update", "absent before 0.5.19: 404", req("POST", "/end_weight_update", {}), ["response.json"]
        ),
        single(
            "unknown_route", "the framework's 404 body", req("GET", "/no_such_route_conformance"), ["response.json"]
        ),
        single(
            "v1_models",
            "OpenAI model list",
            req("GET", "/v1/models"),
            ["response.json.object", "len(response.json.data)", "response.json.data.0.object"],
        ),
        # ---- generate ----------------------------------------------------------------------------------------
        single(
            "generate_ids",
            "token ids in, greedy, max_new_tokens reached",
            req("POST", "/generate", gen_body()),
            LENGTH + ["response.json.meta_info.prompt_tokens", "response.json.meta_info.finish_reason.length"],
        ),
        single(
            "generate_text",
            "text in",
            req("POST", "/generate", gen_body(text=PROMPT)),
            LENGTH + ["response.json.meta_info.prompt_tokens"],
        ),
        single(
            "generate_no_ignore_eos",
            "plain greedy generation: finish_reason is length or stop",
            req("POST", "/generate", gen_body(16, sampling_params={"ignore_eos": False})),
            shape_ignore=["response.json.meta_info.finish_reason"],  # {type, length} or {type, matched}
        ),
        single(
            "generate_logprob",
            "return_logprob: one output entry per completion token, input entries from the default logprob_start_len",
            req("POST", "/generate", gen_body(return_logprob=True)),
            LENGTH
            + [
                "len(response.json.meta_info.output_token_logprobs)",
                "len(response.json.meta_info.input_token_logprobs)",
                "len(response.json.meta_info.output_token_logprobs.*)",
            ],
        ),
        single(
            "generate_logprob_start_len",
            "input_token_logprobs from logprob_start_len 2",
            req("POST", "/generate", gen_body(return_logprob=True, logprob_start_len=2)),
            LENGTH
            + [
                "len(response.json.meta_info.input_token_logprobs)",
                "response.json.meta_info.input_token_logprobs.0.1",
            ],
        ),
        single(
            "generate_logprob_start_len_0",
            "input_token_logprobs of the whole prompt (the first is null)",
            req("POST", "/generate", gen_body(return_logprob=True, logprob_start_len=0)),
            LENGTH
            + [
                "len(response.json.meta_info.input_token_logprobs)",
                "response.json.meta_info.input_token_logprobs.0.0",
                "response.json.meta_info.input_token_logprobs.*.1",
            ],
        ),
        single(
            "generate_top_logprobs",
            "top_logprobs_num 3: k entries per position, input and output",
            req("POST", "/generate", gen_body(return_logprob=True, top_logprobs_num=3, logprob_start_len=0)),
            LENGTH
            + [
                "len(response.json.meta_info.output_top_logprobs)",
                "len(response.json.meta_info.output_top_logprobs.*)",
                "len(response.json.meta_info.input_top_logprobs)",
            ],
        ),
        single(
            "generate_text_in_logprobs",
            "return_text_in_logprobs: a token's text as the third element",
            req("POST", "/generate", gen_body(return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True)),
            LENGTH + ["len(response.json.meta_info.output_token_logprobs.*)"],
        ),
        single(
            "generate_stop_token_ids",
            "stop_token_ids holding every id: the first token stops",
            req(
                "POST",
                "/generate",
                gen_body(8, sampling_params={"stop_token_ids": list(range(vocab_size)), "ignore_eos": False}),
            ),
            LENGTH + ["response.json.meta_info.prompt_tokens"],
        ),
        single(
            "generate_stop_token_ids_ignore_eos",
            "ignore_eos also turns stop_token_ids off (schedule_batch.py)",
            req("POST", "/generate", gen_body(8, sampling_params={"stop_token_ids": list(range(vocab_size))})),
            LENGTH,
        ),
        single(
            "generate_stop_strings",
            "stop strings covering every printable character: stops at once",
            req("POST", "/generate", gen_body(8, sampling_params={"stop": [chr(c) for c in range(32, 127)]})),
            ["response.json.meta_info.finish_reason.type"],
        ),
        single(
            "generate_batch",
            "a batch of two texts: a list of two answers",
            req(
                "POST",
                "/generate",
                {"text": [PROMPT, "Reverse the digits: 12"], "sampling_params": gen_body(4)["sampling_params"]},
            ),
            [
                "len(response.json)",
                "response.json.*.meta_info.completion_tokens",
                "response.json.*.meta_info.finish_reason",
            ],
        ),
        single(
            "generate_batch_ids",
            "a batch of two id lists with per-item sampling params",
            req(
                "POST",
                "/generate",
                {
                    "input_ids": [PROMPT_IDS, PROMPT_IDS[:3]],
                    "sampling_params": [gen_body(3)["sampling_params"], gen_body(5)["sampling_params"]],
                },
            ),
            ["len(response.json)", "response.json.*.meta_info.completion_tokens"],
        ),
        single(
            "generate_stream",
            "stream true: SSE data chunks, cumulative output, then [DONE]",
            req("POST", "/generate", gen_body(8, stream=True)),
            [
                "response.sse.-1",
                "response.sse.-2.meta_info.finish_reason",
                "len(response.sse.-2.output_ids)",
                "response.sse.0.meta_info.finish_reason",
            ],
            invariants=[{"equal": ["response.sse.0.meta_info.id", "response.sse.-2.meta_info.id"]}],
        ),
        single(
            "generate_stream_logprob",
            "stream with log-probs",
            req("POST", "/generate", gen_body(6, stream=True, return_logprob=True)),
            ["response.sse.-1", "len(response.sse.-2.meta_info.output_token_logprobs)"],
        ),
        case(
            "sampling_seed_twice",
            "temperature 1 with sampling_seed: the same output twice",
            [
                step(
                    "first",
                    req(
                        "POST", "/generate", gen_body(16, sampling_params={"temperature": 1.0, "sampling_seed": 1234})
                    ),
                ),  # noqa: E501
                step(
                    "second",
                    req(
                        "POST", "/generate", gen_body(16, sampling_params={"temperature": 1.0, "sampling_seed": 1234})
                    ),
                ),
            ],  # noqa: E501
            ["first.response.json.meta_info.completion_tokens"],
            invariants=[{"equal": ["first.response.json.output_ids", "second.response.json.output_ids"]}],
        ),
        single(
            "generate_rid",
            "a caller's rid comes back as meta_info.id",
            req("POST", "/generate", gen_body(2, rid="conformance-rid-1")),
            ["response.json.meta_info.id"],
        ),
        # ---- malformed ---------------------------------------------------------------------------------------
        single("malformed_json", "invalid JSON", req("POST", "/generate", raw_body='{"text": "abc",')),
        single("malformed_not_object", "a JSON array body", req("POST", "/generate", [1, 2, 3])),
        single("malformed_text_type", "text of the wrong type", req("POST", "/generate", {"text": 5})),
        single(
            "malformed_input_ids_type", "input_ids of the wrong type", req("POST", "/generate", {"input_ids": "abc"})
        ),
        single(
            "malformed_missing_prompt", "neither text nor input_ids", req("POST", "/generate", {"sampling_params": {}})
        ),  # noqa: E501
        single(
            "malformed_both_prompts",
            "text and input_ids",
            req("POST", "/generate", {**gen_body(2), "text": PROMPT}),
        ),
        single(
            "malformed_sampling_type",
            "max_new_tokens of the wrong type",
            req("POST", "/generate", gen_body(sampling_params={"max_new_tokens": "many"})),
        ),
        single(
            "malformed_sampling_range",
            "temperature out of range",
            req("POST", "/generate", gen_body(sampling_params={"temperature": -1.0})),
        ),
        single(
            "unknown_top_level_field",
            "an unknown field at the top level of /generate",
            req("POST", "/generate", gen_body(2, conformance_unknown_field=1)),
        ),
        single(
            "unknown_sampling_field",
            "an unknown sampling param",
            req("POST", "/generate", gen_body(2, sampling_params={"conformance_unknown": 1})),
        ),
        single(
            "malformed_pause_mode",
            "/pause_generation with an unknown mode",
            req("POST", "/pause_generation", {"mode": "bogus"}),
        ),
        single(
            "malformed_abort_type",
            "/abort_request with abort_all of the wrong type",
            req("POST", "/abort_request", {"abort_all": [1]}),
        ),
        single(
            "malformed_update_weight_version",
            "/update_weight_version without new_version",
            req("POST", "/update_weight_version", {}),
        ),
        single(
            "unknown_field_pause",
            "/pause_generation with an unknown field (then /continue_generation)",
            req("POST", "/pause_generation", {"mode": "abort", "conformance_unknown": 1}),
        ),
        single("continue_after_unknown", "/continue_generation", req("POST", "/continue_generation", {})),
        single("malformed_wrong_method", "GET on a POST-only route", req("GET", "/abort_request")),
    ]
