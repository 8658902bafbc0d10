"""The SGLang releases the fake can speak, and what differs between them (`--sglang-version`).

Read from each release's python/sglang/srt/entrypoints/http_server.py, managers/io_struct.py and
entrypoints/openai/protocol.py; the fake keeps its own table (not slime's) so a test of slime's version handling
against the fake checks two readings of SGLang, not one reading twice.

What is verified and what is only read. One release has been recorded from a real server: 0.5.17
(tests/fixtures/sglang-0.5.17/, replayed by tests/unit/test_sglang_conformance.py). Every behaviour a fixture
covers is verified for 0.5.17 — the `/generate` answer and its `meta_info`, log-probs, streaming, abort, pause,
flush, memory release, the info endpoints, the error shapes, `/v1/models`, the chat route. The other releases'
behaviour, 0.5.23's (the default) included, is read from their source only; where a release differs from 0.5.17
the difference is gated here:

- 0.5.21 added the weight-update session (`/begin_weight_update`, `/end_weight_update`; scheduler_components/
  weight_updater.py refuses `update_weights_from_tensor` / `_from_distributed` outside one) and `/weights_checker`'s
  `skip_tensor_list`; it removed `/get_weight_version`, which 0.5.14-0.5.20 answer with a 404 and a pointer to
  `/model_info` (verified on 0.5.17).
- Before 0.5.21 the checker's `parallelism_info` has no `role` (utils/weight_checker.py: ParallelismInfo).
- 0.5.22 added the `/generate` JSON contract (http_server.py `generate_request` calls api_contract.py
  `generate_contract_error`: 400 `{"error": "<text>"}`). Before it, a sampling param SamplingParams does not know,
  or one whose type breaks SGLang's arithmetic, raises a TypeError that nothing catches: 500 "Internal Server
  Error" as plain text (verified on 0.5.17).
- `/model_info`: `embedding` (the resolved embedding plan) since 0.5.17; `served_model_name`, `load_format`,
  `reasoning_parser`, `tool_call_parser` since 0.5.18; `disaggregation_mode` since 0.5.22.
- The chat completion: 0.5.22 drops `message.tool_calls` when there are none; 0.5.23 adds
  `usage.completion_tokens_details` (null without reasoning tokens).
"""

from __future__ import annotations

SGLANG_VERSIONS = tuple(f"0.5.{n}" for n in range(14, 24))  # oldest first; the default is the newest
RECORDED_VERSIONS = ("0.5.17",)  # releases a conformance recording verifies (tests/fixtures/sglang-<version>/)


def release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split(".")[:3])


def has_update_sessions(version: str) -> bool:
    return release(version) >= (0, 5, 21)


def has_json_contract(version: str) -> bool:
    """http_server.py `generate_request` checks the body against api_contract.py from 0.5.22 on."""
    return release(version) >= (0, 5, 22)


def model_info_extras(version: str) -> tuple[str, ...]:
    """The `/model_info` keys a release has beyond 0.5.14's (http_server.py `model_info`)."""
    keys: list[str] = []
    if release(version) >= (0, 5, 17):
        keys.append("embedding")
    if release(version) >= (0, 5, 18):
        keys += ["served_model_name", "load_format", "reasoning_parser", "tool_call_parser"]
    if release(version) >= (0, 5, 22):
        keys.append("disaggregation_mode")
    return tuple(keys)


def chat_drops_empty_tool_calls(version: str) -> bool:
    """openai/protocol.py ChatMessage `_serialize` pops `tool_calls` when None from 0.5.22 on."""
    return release(version) >= (0, 5, 22)


def chat_has_completion_tokens_details(version: str) -> bool:
    """openai/protocol.py UsageInfo gains `completion_tokens_details` in 0.5.23."""
    return release(version) >= (0, 5, 23)
