"""Record SGLang's answers to a fixed, ordered set of requests as conformance fixtures.

    python scripts/record_sglang_conformance.py --url http://127.0.0.1:30000 --out tests/fixtures/sglang-0.5.17 \
        [--model-path MODEL] [--server-argv "python -m sglang.launch_server ..."]

Writes one JSON file per case into --out and ``index.json`` (the server's version from `/server_info`, the date,
the server's argv, the cases in order, the ones that failed). Fixture format and the comparison:
sim/fake_sglang/conformance.py. A case that errors (a timeout, a refused connection, a crashed server) is recorded
as such; the run never raises and is bounded in time (every request has a timeout, the whole run a deadline).

Needs only the stdlib and httpx (torch, where importable, builds the one payload that must be a real pickled
tensor: the wrong-name weight update; without it that case is recorded as an error). The requests follow SGLang's
own source (python/sglang/srt/entrypoints/http_server.py routes, python/sglang/srt/managers/io_struct.py bodies);
they assume the toy model of examples/toy/prepare.py (a Qwen2 with a vocabulary under 512 and a Qwen2-style chat
template). Cases that can take the server down (unpicklable payloads reach the scheduler) run last.

`run_case` also replays a recorded fixture against another server (tests/unit/test_sglang_conformance.py).
"""

from __future__ import annotations

import argparse
import base64
import datetime as _dt
import json
import logging
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: sim.fake_sglang
from sim.fake_sglang.conformance import DONE, check_invariants  # noqa: E402 - pure stdlib

logger = logging.getLogger(__name__)

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


def build_cases(vocab_size: int, torch_payloads: dict[str, str | None]) -> list[dict]:
    """The fixed, ordered list. `torch_payloads`: base64 pickles that need torch to build (None: unavailable)."""
    cases = [
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
        # ---- abort / pause / flush with a request in flight ----------------------------------------------------
        single(
            "flush_cache_idle", "/flush_cache with nothing running", req("POST", "/flush_cache"), ["response.text"]
        ),  # noqa: E501
        single("flush_cache_get", "/flush_cache by GET", req("GET", "/flush_cache"), ["response.text"]),
        case(
            "abort_rid",
            "abort one running request by rid: it answers abort with its tokens so far",
            [
                step("background", req("POST", "/generate", long_body("conformance-abort-1")), background=True),
                step("abort", req("POST", "/abort_request", {"rid": "conformance-abort-1"}), delay_s=START_DELAY_S),
            ],
            ABORTED + ["background.response.json.meta_info.id"],
            main="abort",
            invariants=TOKENS_SO_FAR,
        ),
        case(
            "abort_unknown_rid",
            "abort of an rid nobody runs",
            [step("main", req("POST", "/abort_request", {"rid": "conformance-no-such-rid"}))],
            ["main.response.text"],
        ),
        case(
            "abort_all",
            "abort_all with a request running",
            [
                step("background", req("POST", "/generate", long_body("conformance-abort-2")), background=True),
                step("abort", req("POST", "/abort_request", {"abort_all": True}), delay_s=START_DELAY_S),
            ],
            ABORTED,
            main="abort",
            invariants=TOKENS_SO_FAR,
        ),
        case(
            "flush_cache_running",
            "/flush_cache while a request runs: refused",
            [
                step("background", req("POST", "/generate", long_body("conformance-flush-1")), background=True),
                step("flush", req("POST", "/flush_cache"), delay_s=START_DELAY_S),
                step("cleanup", req("POST", "/abort_request", {"rid": "conformance-flush-1"})),
            ],
            ["flush.response.text"] + ABORTED,
            main="flush",
        ),
        case(
            "pause_abort",
            "pause mode abort: the running request answers abort; continue resumes serving",
            [
                step("background", req("POST", "/generate", long_body("conformance-pause-1")), background=True),
                step("pause", req("POST", "/pause_generation", {"mode": "abort"}), delay_s=START_DELAY_S),
                step("continue", req("POST", "/continue_generation", {}), delay_s=0.3),
                step("after", req("POST", "/generate", gen_body(2))),
            ],
            ABORTED + ["pause.response.json", "continue.response.json", "after.response.json.meta_info.finish_reason"],
            main="pause",
            invariants=TOKENS_SO_FAR,
        ),
        case(
            "pause_in_place",
            "pause in_place: the request waits, flush is refused, continue finishes it",
            [
                step("background", req("POST", "/generate", long_body("conformance-pause-2", 400)), background=True),
                step("pause", req("POST", "/pause_generation", {"mode": "in_place"}), delay_s=0.3),
                step("flush", req("POST", "/flush_cache"), delay_s=0.3),
                step("continue", req("POST", "/continue_generation", {}), delay_s=0.3),
            ],
            [
                "background.response.json.meta_info.finish_reason",
                "background.response.json.meta_info.completion_tokens",
                "pause.response.json",
                "continue.response.json",
            ],
            main="pause",
        ),
        case(
            "pause_retract",
            "pause retract: the request goes back to waiting, flush succeeds, continue finishes it",
            [
                step("background", req("POST", "/generate", long_body("conformance-pause-3", 400)), background=True),
                step("pause", req("POST", "/pause_generation", {"mode": "retract"}), delay_s=0.3),
                step("flush", req("POST", "/flush_cache"), delay_s=0.3),
                step("continue", req("POST", "/continue_generation", {}), delay_s=0.3),
            ],
            [
                "background.response.json.meta_info.finish_reason",
                "background.response.json.meta_info.completion_tokens",
                "pause.response.json",
                "continue.response.json",
            ],
            main="pause",
        ),
        single(
            "pause_default_idle",
            "pause with no body (mode abort by default) while idle",
            req("POST", "/pause_generation", {}),
            ["response.json"],
        ),
        single("continue_idle", "continue", req("POST", "/continue_generation", {}), ["response.json"]),
        # ---- weights: metadata -------------------------------------------------------------------------------
        single(
            "weights_checker_checksum",
            "checksum of the served weights",
            req("POST", "/weights_checker", {"action": "checksum"}),
            ["response.json.success", "len(response.json.ranks)"],
            shape_ignore=["response.json.ranks.*.checksums"],
        ),
        single(
            "weights_checker_bad_action",
            "an unknown action",
            req("POST", "/weights_checker", {"action": "conformance_bogus"}),
            ["response.json.success"],
        ),
        single(
            "get_weights_by_name",
            "the first values of a parameter",
            req("POST", "/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 2}),
            ["len(response.json)"],
        ),
        single(
            "get_weights_by_name_unknown",
            "an unknown parameter name",
            req("POST", "/get_weights_by_name", {"name": "model.no_such_weight", "truncate_size": 2}),
        ),
        case(
            "update_weight_version",
            "new_version becomes /model_info's and meta_info's weight_version",
            [
                step("main", req("POST", "/update_weight_version", {"new_version": "conformance-v1"})),
                step("model_info", req("GET", "/model_info")),
                step("generate", req("POST", "/generate", gen_body(1))),
            ],
            [
                "main.response.json",
                "model_info.response.json.weight_version",
                "generate.response.json.meta_info.weight_version",
            ],
        ),
        # ---- weights: update errors (the safe ones) ------------------------------------------------------------
        single(
            "update_from_tensor_bad_base64",
            "serialized_named_tensors that is not base64",
            req("POST", "/update_weights_from_tensor", {"serialized_named_tensors": ["!!not base64!!"]}),
        ),
        single(
            "update_from_tensor_missing_field",
            "no serialized_named_tensors",
            req("POST", "/update_weights_from_tensor", {"flush_cache": True}),
        ),
        single(
            "update_from_disk_missing_path",
            "a model_path that does not exist",
            req("POST", "/update_weights_from_disk", {"model_path": "/nonexistent/conformance-model"}),
            ["response.json.success"],
        ),
        case(
            "release_resume_memory",
            "release then resume (--enable-memory-saver), then generate",
            [
                step("release", req("POST", "/release_memory_occupation", {})),
                step("resume", req("POST", "/resume_memory_occupation", {}), delay_s=0.2),
                step("generate", req("POST", "/generate", gen_body(2))),
            ],
            ["release.response.text", "resume.response.text", "generate.response.json.meta_info.completion_tokens"],
        ),
        case(
            "release_resume_tags",
            "release and resume by tags",
            [
                step("release", req("POST", "/release_memory_occupation", {"tags": ["kv_cache"]})),
                step("resume", req("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}), delay_s=0.2),
            ],
            ["release.response.text", "resume.response.text"],
        ),
        # ---- OpenAI chat -------------------------------------------------------------------------------------
        single(
            "chat_completions",
            "non-streaming chat through the model's chat template",
            req(
                "POST",
                "/v1/chat/completions",
                {
                    "model": "default",
                    "messages": [{"role": "user", "content": "What is 2+2?"}],
                    "max_tokens": 4,
                    "temperature": 0.0,
                },
            ),
            ["response.json.object", "len(response.json.choices)", "response.json.choices.0.message.role"],
            any_type=["response.json.choices.*.matched_stop"],  # a stop token id, a stop string or null
        ),
        single(
            "chat_completions_bad", "chat without messages", req("POST", "/v1/chat/completions", {"model": "default"})
        ),  # noqa: E501
    ]
    # ---- weights: payloads that reach the scheduler's unpickler: these may take the server down, so they go last
    cases.append(
        single(
            "update_from_tensor_blocked_pickle",
            "a pickle of a class outside SGLang's unpickling allow-list",
            req(
                "POST",
                "/update_weights_from_tensor",
                {"serialized_named_tensors": [_blocked_pickle()], "flush_cache": False},
            ),
        )
    )
    wrong = torch_payloads.get("wrong_name")
    cases.append(
        single(
            "update_from_tensor_wrong_name",
            "a real tensor under a name the model does not have",
            req(
                "POST",
                "/update_weights_from_tensor",
                {
                    "serialized_named_tensors": [wrong if wrong is not None else "TORCH_UNAVAILABLE"],
                    "flush_cache": False,
                },
            ),
        )
    )
    cases.append(single("health_at_end", "is the server alive after the unpicklable payloads", req("GET", "/health")))
    return cases


def _blocked_pickle() -> str:
    import decimal  # a harmless class whose module SGLang's SafeUnpickler refuses

    return base64.b64encode(pickle.dumps([("model.embed_tokens.weight", decimal.Decimal(1))])).decode()


def torch_payloads() -> dict[str, str | None]:
    """Payloads that need torch: a CPU tensor pickled whole (its bytes in the pickle, so the fixture replays)."""
    try:
        import torch
    except ImportError:
        return {"wrong_name": None}
    obj = [("model.conformance_no_such_layer.weight", torch.zeros(4, dtype=torch.float32))]
    return {"wrong_name": base64.b64encode(pickle.dumps(obj)).decode()}


# ---- running --------------------------------------------------------------------------------------------------
def parse_sse(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data:"):
                data = line[5:].strip()
                if data == DONE:
                    out.append(DONE)
                else:
                    try:
                        out.append(json.loads(data))
                    except ValueError:
                        out.append({"unparsed": data})
    return out


def send(url: str, request: dict, timeout_s: float) -> dict:
    """One request; the answer as a fixture's `response` (never raises: a failure is `error`)."""
    t0 = time.monotonic()
    kw: dict[str, Any] = {"params": request.get("query") or None}
    if "raw_body" in request:
        kw["content"] = request["raw_body"].encode()
        kw["headers"] = {"Content-Type": "application/json"}
    elif "body" in request:
        kw["json"] = request["body"]
    try:
        with httpx.Client(base_url=url, timeout=timeout_s) as c:
            r = c.request(request["method"], request["path"], **kw)
    except Exception as e:  # noqa: BLE001 - recorded, never raised
        return {"status": None, "error": f"{type(e).__name__}: {e}", "elapsed_s": round(time.monotonic() - t0, 3)}
    out: dict[str, Any] = {"status": r.status_code, "content_type": r.headers.get("content-type")}
    text = r.text
    if "text/event-stream" in (out["content_type"] or ""):
        out["sse"] = parse_sse(text)
    else:
        try:
            out["json"] = json.loads(text) if text.strip() else None
        except ValueError:
            out["json"] = None
        if out["json"] is None:
            del out["json"]
            out["text"] = text
    out["elapsed_s"] = round(time.monotonic() - t0, 3)
    return out


def run_case(url: str, fixture: dict, deadline: float | None = None) -> dict:
    """Run a case's steps against `url` (a new case, or a recorded fixture replayed: its requests are sent as
    recorded) and return the fixture with the answers filled in. Background steps answer when they end."""
    out = json.loads(json.dumps({k: v for k, v in fixture.items() if k not in ("request", "response", "errors")}))
    threads: list[tuple[dict, threading.Thread]] = []
    for s in out["steps"]:
        s.pop("response", None)
        if deadline is not None and time.monotonic() > deadline:
            s["response"] = {"status": None, "error": "not run: the recorder's run deadline passed"}
            continue
        if s.get("delay_s"):
            time.sleep(float(s["delay_s"]))
        if s.get("background"):
            t = threading.Thread(target=lambda s=s: s.__setitem__("response", send(url, s["request"], s["timeout_s"])))
            t.start()
            threads.append((s, t))
        else:
            s["response"] = send(url, s["request"], s["timeout_s"])
    for s, t in threads:
        t.join(s["timeout_s"] + 5)
        if t.is_alive():
            s["response"] = {"status": None, "error": "background request still running past its timeout"}
    if threads or any(s["request"]["path"] == "/pause_generation" for s in out["steps"]):
        send(url, {"method": "POST", "path": "/continue_generation", "body": {}}, 5.0)  # leave the server serving
    main = {s["name"]: s for s in out["steps"]}[out["main"]]
    out = {"case": out["case"], "why": out["why"], "request": main["request"], "response": main["response"], **out}
    errors = [f"{s['name']}: {s['response']['error']}" for s in out["steps"] if "error" in s["response"]]
    errors += [str(d) for d in check_invariants(out)]
    if errors:
        out["errors"] = errors
    return out


def record(url: str, out_dir: Path, model_path: str | None, server_argv: str | None) -> dict:
    t_start = time.monotonic()
    deadline = t_start + RUN_DEADLINE_S
    vocab = VOCAB_GUESS
    if model_path:
        try:
            vocab = int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])
        except (OSError, ValueError, KeyError) as e:
            logger.warning("vocab size of %s not read (%s): using %d", model_path, e, vocab)
    info = send(url, {"method": "GET", "path": "/server_info"}, REQUEST_TIMEOUT_S)
    version = (info.get("json") or {}).get("version") if isinstance(info.get("json"), dict) else None
    out_dir.mkdir(parents=True, exist_ok=True)
    names, failed = [], []
    for c in build_cases(vocab, torch_payloads()):
        t0 = time.monotonic()
        try:
            fx = run_case(url, c, deadline)
        except Exception as e:  # noqa: BLE001 - a bug in one case must not lose the others
            fx = {**c, "errors": [f"recorder: {type(e).__name__}: {e}"]}
        (out_dir / f"{c['case']}.json").write_text(json.dumps(fx, indent=1, ensure_ascii=False) + "\n")
        names.append(c["case"])
        if fx.get("errors"):
            failed.append({"case": c["case"], "errors": fx["errors"]})
        statuses = [s.get("response", {}).get("status") for s in fx.get("steps", [])]
        print(
            f"{c['case']:<36} {time.monotonic() - t0:6.2f}s  status {statuses}  {'FAILED' if fx.get('errors') else ''}"
        )  # noqa: E501
    index = {
        "server_version": version,
        "url": url,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "server_argv": server_argv,
        "model_path": model_path,
        "vocab_size": vocab,
        "recorder": "scripts/record_sglang_conformance.py",
        "duration_s": round(time.monotonic() - t_start, 2),
        "cases": names,
        "failed": failed,
    }
    (out_dir / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    return index


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the SGLang(-protocol) server, http://HOST:PORT")
    p.add_argument("--out", required=True, help="directory for the fixtures and index.json")
    p.add_argument("--model-path", default=None, help="the served model's directory (its vocabulary size)")
    p.add_argument("--server-argv", default=None, help="the server's command line, kept in index.json")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    index = record(a.url.rstrip("/"), Path(a.out), a.model_path, a.server_argv)
    print(f"server version {index['server_version']}: {len(index['cases'])} cases in {index['duration_s']}s, "
          f"{len(index['failed'])} with errors -> {a.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
