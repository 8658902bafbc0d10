"""The recorder's cases that change the server: requests in flight aborted or paused, weights, chat, and last the
payloads that may take a 0.5.17 server down (scripts/sglang_conformance_cases.py holds the rest and the helpers)."""

from __future__ import annotations

import base64
import pickle

from scripts.sglang_conformance_cases import (
    ABORTED,
    START_DELAY_S,
    TOKENS_SO_FAR,
    case,
    gen_body,
    long_body,
    req,
    single,
    step,
)


def control_cases(torch_payloads: dict[str, str | None]) -> list[dict]:
    """`torch_payloads`: base64 pickles that need torch to build (None: unavailable)."""
    cases = [
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
