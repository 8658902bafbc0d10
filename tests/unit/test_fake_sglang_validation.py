"""The fake server refuses malformed input with SGLang 0.5.23's own status, error shape and wording.

Each row was read from SGLang's source (python/sglang/srt/entrypoints/http_server.py: the validation and
HTTPException handlers, `_create_error_response`, `generate_request`'s JSON contract; io_struct.py request classes;
sampling_params.py `verify`) and, for the pydantic and contract layers, checked against SGLang's own validators in
the side venv. The property suite (tests/property/test_fake_sglang_malformed_server.py) covers the space; this table
pins the exact answers.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from sim.fake_sglang.server import build_app
from sim.fake_sglang.synthetic_engine import DEFAULT_CONFIG, SyntheticEngine

pytestmark = pytest.mark.cpu

J = {"Content-Type": "application/json"}
VALIDATION = "validation"  # 400 {"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}
CONTRACT = "contract"  # 400 {"error": "<text>"}
VALUE_ERROR = "value_error"  # 400 {"error": {"message": "<text>"}}
WEIGHTS = "weights"  # 400 {"success": false, "message": "<text>"}

CASES = [
    # FastAPI reads the body: not JSON, not under a JSON content type, empty, too deep
    ("/generate", b"{not json", J, VALIDATION, "json_invalid"),
    ("/generate", b'{"input_ids": [1]}', {"Content-Type": "text/plain"}, VALIDATION, "dataclass_type"),
    ("/generate", b"", J, VALIDATION, "Field required"),
    ("/generate", b"[" * 5000 + b"]" * 5000, J, "parse", "There was an error parsing the body"),
    ("/generate", b"\xff{", J, "parse", "There was an error parsing the body"),  # not UTF-8
    # pydantic's lax parse of GenerateReqInput
    ("/generate", b"[1, 2]", J, VALIDATION, "Input should be a dictionary or an instance of GenerateReqInput"),
    ("/generate", b'{"input_ids": "abc"}', J, VALIDATION, "must be list or null; got str"),
    ("/generate", b'{"input_ids": [1.5]}', J, VALIDATION, "elements must be int or list; got float"),
    ("/generate", b'{"input_ids": [1180591620717411303424]}', J, VALIDATION, "contains non-int64 element"),
    ("/generate", b'{"input_ids": [1], "sampling_params": 3}', J, VALIDATION, "Input should be a valid dictionary"),
    ("/generate", b'{"text": 5}', J, VALIDATION, "Input should be a valid string"),
    ("/generate", b'{"text": "a", "\\ud800": 1}', J, VALIDATION, "unable to parse raw data as a unicode string"),
    ("/generate", b'{"text": "a", "return_text_in_logprobs": null}', J, VALIDATION, "Input should be a valid boolean"),
    # then the JSON contract (strict types, no unknown sampling keys)
    ("/generate", b'{"input_ids": [1], "sampling_params": {"temperature": "0.5"}}', J, CONTRACT,
     'invalid type: string "0.5", expected f64'),
    ("/generate", b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 5.0}}', J, CONTRACT,
     "invalid type: floating point `5.0`, expected i64"),
    ("/generate", b'{"input_ids": [1], "sampling_params": {"max_tokens": 5}}', J, CONTRACT, "unknown field `max_tokens`"),
    ("/generate", b'{"input_ids": [1], "stream": "true"}', J, CONTRACT, 'invalid type: string "true", expected a boolean'),
    ("/generate", b'{"input_ids": [true]}', J, CONTRACT, "invalid type: boolean `true`, expected a sequence"),
    # then tokenizer_manager.py / io_struct.py / sampling_params.py ValueErrors
    ("/generate", b"{}", J, VALUE_ERROR, "Either text, input_ids or input_embeds should be provided."),
    ("/generate", b'{"input_ids": []}', J, VALUE_ERROR, "input_ids cannot be empty."),
    ("/generate", b'{"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}', J, VALUE_ERROR,
     "max_new_tokens must be at least 0, got -1."),
    ("/generate", b'{"input_ids": [1], "sampling_params": {"temperature": -1}}', J, VALUE_ERROR,
     "temperature must be a non-negative finite number, got -1"),
    ("/generate", b'{"input_ids": [1], "sampling_params": {"top_p": 0}}', J, VALUE_ERROR, "top_p must be in (0, 1]"),
    ("/generate", b'{"input_ids": [1], "sampling_params": {"top_k": 0}}', J, VALUE_ERROR,
     "top_k must be -1 (disable) or at least 1, got 0."),
    ("/generate", b'{"input_ids": [[1], [2]], "rid": ["a", "a"]}', J, VALUE_ERROR,
     "Duplicate request IDs detected within the request: ['a']"),
    ("/generate", b'{"input_ids": [[1], [2]], "rid": ["a"]}', J, VALUE_ERROR, "The specified rids length mismatch"),
    # the fake's own refusals where SGLang has no check before the model (see engine.py, protocol.py)
    ("/generate", b'{"input_ids": [512]}', J, VALUE_ERROR, "input_ids out of range for vocab size 512"),
    ("/generate", b'{"text": "\\ud800"}', J, VALUE_ERROR, "lone surrogate"),
    # request classes of the control endpoints (msgspec structs, lax pydantic)
    ("/abort_request", b'{"rid": 5}', J, VALIDATION, "Input should be a valid string"),
    ("/abort_request", b'{"abort_all": 2}', J, VALIDATION, "Input should be a valid boolean, unable to interpret"),
    ("/pause_generation", b'{"mode": "bogus"}', J, VALIDATION, "Input should be 'abort', 'retract' or 'in_place'"),
    ("/update_weight_version", b"{}", J, VALIDATION, "Field required"),
    ("/update_weights_from_disk", b'{"model_path": 3}', J, VALIDATION, "Input should be a valid string"),
    ("/update_weights_from_tensor", b'{"serialized_named_tensors": ["YW Jj"]}', J, VALIDATION,
     "Expected base64-encoded bytes"),
    ("/update_weights_from_tensor", b'{"serialized_named_tensors": ["/w=="]}', J, WEIGHTS,
     "must run between begin_weight_update() and end_weight_update()"),
    ("/init_weights_update_group", b'{"master_address": "a", "master_port": 5.5, "rank_offset": 1, "world_size": 2}',
     J, VALIDATION, "got a number with a fractional part"),
    ("/update_weights_from_distributed", b'{"names": ["a"], "dtypes": ["x"], "shapes": [2]}', J, VALIDATION,
     "Input should be a valid list"),
    ("/update_weights_from_distributed", b'{"names": ["a"], "dtypes": ["float32"], "shapes": [[2]]}', J, WEIGHTS,
     "must run between begin_weight_update() and end_weight_update()"),
    ("/begin_weight_update", b'{"selector": "x"}', J, VALIDATION, "Input should be 'target', 'draft' or 'all'"),
    ("/end_weight_update", b"", J, VALIDATION, "Field required"),
    ("/release_memory_occupation", b'{"tags": "weights"}', J, VALIDATION, "Input should be a valid list"),
    ("/weights_checker", b'{"allow_quant_error": "x"}', J, VALIDATION, "Input should be a valid boolean"),
    ("/flush_cache?timeout=-1", b"", {}, VALIDATION, "Input should be greater than or equal to 0"),
]  # fmt: skip


async def _answers(requests: list[tuple[str, str, bytes, dict]], version: str = "0.5.23") -> list[tuple[int, str]]:
    engine = SyntheticEngine(config=dict(DEFAULT_CONFIG, output_len={"dist": "fixed", "value": 2}))
    task = asyncio.create_task(engine.run())
    out = []
    app = build_app(engine, server_args={"tp_size": 1, "sglang_version": version})
    try:
        async with TestClient(TestServer(app, host="127.0.0.1")) as c:
            for method, path, body, headers in requests:
                async with c.request(method, path, data=body, headers=headers) as r:
                    out.append((r.status, await r.text()))
    finally:
        await engine.stop()
        task.cancel()
    return out


def test_malformed_bodies_get_sglangs_status_shape_and_words():
    answers = asyncio.run(_answers([("POST", path, body, h) for path, body, h, _, _ in CASES]))
    for (path, body, _, shape, words), (status, text) in zip(CASES, answers, strict=True):
        what = f"{path} {body[:80]!r}: {status} {text[:400]}"
        assert status == 400, what
        got = json.loads(text)
        if shape == VALIDATION:
            assert set(got) == {"object", "message", "type", "param", "code"}, what
            assert got["object"] == "error" and got["type"] == "Bad Request" and got["code"] == 400, what
            assert "validation error" in got["message"] and words in got["message"], what
        elif shape == "parse":
            assert got == {"object": "error", "message": words, "type": "400", "param": None, "code": 400}, what
        elif shape == CONTRACT:
            assert set(got) == {"error"} and isinstance(got["error"], str) and words in got["error"], what
        elif shape == VALUE_ERROR:
            assert set(got) == {"error"} and set(got["error"]) == {"message"}, what
            assert words in got["error"]["message"], what
        else:
            assert got["success"] is False and words in got["message"], what


def _payload(obj: object) -> bytes:
    import base64
    import pickle

    return json.dumps({"serialized_named_tensors": [base64.b64encode(pickle.dumps(obj)).decode()]}).encode()


@pytest.mark.parametrize("version", ["0.5.17", "0.5.23"])
def test_weight_payloads_are_unpickled_as_sglangs_safe_unpickler_does(version):
    """A payload is refused before it loads unless its classes come from the modules SGLang's SafeUnpickler admits
    (python/sglang/srt/utils/common.py): slime's metadata travels as `types.SimpleNamespace` for that reason. 0.5.23
    loads only inside an update session, 0.5.17 has none (its /begin_weight_update is a 404)."""
    import argparse
    import types

    sessions = version == "0.5.23"
    begin = [("POST", "/begin_weight_update", b"{}", J)] if sessions else []
    end = [("POST", "/end_weight_update", b"{}", J)] if sessions else []
    refused = ("POST", "/update_weights_from_tensor", _payload(argparse.Namespace(a=1)), J)
    admitted = ("POST", "/update_weights_from_tensor", _payload([types.SimpleNamespace(name="x")]), J)
    answers = asyncio.run(
        _answers([*begin, refused, admitted, *end, ("POST", "/begin_weight_update", b"{}", J)], version)
    )
    if sessions:
        assert [s for s, _ in answers[:1] + answers[-2:]] == [200, 200, 200]
        answers = answers[1:-2]
    else:
        assert answers[-1][0] == 404
        answers = answers[:-1]
    (s1, t1), (s2, t2) = answers
    assert s1 == 400 and "Blocked unsafe class loading (argparse.Namespace)" in json.loads(t1)["message"], t1
    # unpickled, then refused for what it holds (not a list of (name, tensor)): past the unpickler's gate
    assert s2 == 400 and "Blocked" not in json.loads(t2)["message"], t2


def test_what_sglang_accepts_the_fake_accepts():
    """The other side of the table: inputs SGLang takes (lax coercions, an unknown rid, a null optional body)."""
    ok = [
        ("POST", "/abort_request", b'{"rid": "no-such-request"}', J),  # an unknown rid is no error
        ("POST", "/abort_request", b'{"abort_all": "false"}', J),  # lax bool
        ("POST", "/abort_request", b"{}", J),  # an empty rid without abort_all is ignored
        ("POST", "/generate", b'{"input_ids": [1], "rid": "r", "unknown_top_level": {"x": [1]}}', J),
        ("PUT", "/generate", b'{"text": "hi", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}', J),
        ("POST", "/generate", b'{"input_ids": [[1], [2]], "rid": "grp", "sampling_params": [{}, {"n": 1}]}', J),
        ("POST", "/continue_generation", b"{}", J),
        ("GET", "/flush_cache?timeout=0.5", b"ignored", {}),
        ("POST", "/update_weight_version", b'{"new_version": "v2", "abort_all_requests": "no"}', J),
        ("POST", "/update_weight_version", b'{"new_version": "default"}', J),
        ("POST", "/destroy_weights_update_group", b"{}", J),  # answered, as SGLang: success false, 400
    ]
    answers = asyncio.run(_answers(ok))
    assert [s for s, _ in answers] == [200] * 10 + [400]
    assert json.loads(answers[-1][1]) == {"success": False, "message": "The group to be destroyed does not exist."}
    grp = json.loads(answers[5][1])
    assert [o["meta_info"]["id"] for o in grp] == ["grp_0", "grp_1"]
