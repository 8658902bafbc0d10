"""The conformance comparer (sim/fake_sglang/conformance.py), including its negative control: a field removed from
an answer, a type changed and a deterministic value changed are each reported."""

from __future__ import annotations

import copy

import pytest

from sim.fake_sglang.conformance import MISSING, compare_fixture, json_type, resolve

pytestmark = pytest.mark.cpu


def _generate_fixture() -> dict:
    answer = {
        "text": "abc",
        "output_ids": [4, 5, 6],
        "meta_info": {
            "id": "r1",
            "finish_reason": {"type": "length", "length": 3},
            "prompt_tokens": 2,
            "completion_tokens": 3,
            "e2e_latency": 0.01,
            "output_token_logprobs": [[-0.5, 4, None], [-0.25, 5, None], [-1.5, 6, None]],
            "output_top_logprobs": [[[-0.5, 4, None], [-0.7, 9, None]]] * 3,
        },
    }
    response = {"status": 200, "content_type": "application/json", "json": answer, "elapsed_s": 0.02}
    request = {"method": "POST", "path": "/generate", "query": {}, "body": {"input_ids": [1, 2]}}
    return {
        "case": "gen",
        "why": "test",
        "main": "main",
        "request": request,
        "response": response,
        "steps": [{"name": "main", "request": request, "response": response}],
        "deterministic": [
            "main.response.status",
            "response.json.meta_info.finish_reason.type",
            "response.json.meta_info.completion_tokens",
            "len(response.json.output_ids)",
            "len(response.json.meta_info.output_top_logprobs.*)",
        ],
    }


def _answer(fx: dict) -> dict:
    return fx["steps"][0]["response"]["json"]


def _kinds(diffs) -> set[tuple[str, str]]:
    return {(d.path, d.kind) for d in diffs}


def test_the_same_shape_with_other_values_passes():
    rec = _generate_fixture()
    other = copy.deepcopy(rec)
    a = _answer(other)
    a["text"], a["output_ids"] = "zzz", [9, 9, 9]
    a["meta_info"].update(id="other", e2e_latency=3.5)
    a["meta_info"]["output_token_logprobs"][0][0] = -9.0
    assert compare_fixture(rec, other) == []


def test_negative_control_missing_field_type_and_value_are_each_reported():
    rec = _generate_fixture()
    broken = copy.deepcopy(rec)
    a = _answer(broken)
    del a["meta_info"]["prompt_tokens"]  # a field removed
    a["meta_info"]["e2e_latency"] = "fast"  # a type changed
    a["meta_info"]["finish_reason"]["type"] = "stop"  # a deterministic value changed
    diffs = compare_fixture(rec, broken)
    for d in diffs:
        print(d)  # the negative control's output, for the report (pytest -s)
    got = _kinds(diffs)
    assert ("main.response.json.meta_info.prompt_tokens", "missing") in got
    assert ("main.response.json.meta_info.e2e_latency", "type") in got
    assert ("response.json.meta_info.finish_reason.type", "value") in got
    assert len(diffs) == 3


def test_extra_field_tuple_length_empty_list_and_status():
    rec = _generate_fixture()
    broken = copy.deepcopy(rec)
    broken["steps"][0]["response"]["status"] = 400
    a = _answer(broken)
    a["meta_info"]["bonus"] = 1
    a["meta_info"]["output_token_logprobs"] = [[-0.5, 4]] * 3  # a tuple lost its text element
    a["meta_info"]["output_top_logprobs"] = [[[-0.5, 4, None]]] * 3  # k=1 where 2 were recorded
    got = _kinds(compare_fixture(rec, broken))
    assert ("main.response.status", "value") in got
    assert ("main.response.json.meta_info.bonus", "extra") in got
    assert ("len(main.response.json.meta_info.output_token_logprobs.0)", "length") in got
    assert ("len(response.json.meta_info.output_top_logprobs.0)", "value") in got
    a["meta_info"]["output_token_logprobs"] = []
    assert ("main.response.json.meta_info.output_token_logprobs", "empty") in _kinds(compare_fixture(rec, broken))


def test_sse_chunks_shape_ignore_required_and_invariants():
    chunk = {"text": "a", "meta_info": {"finish_reason": None}}
    last = {"text": "ab", "meta_info": {"finish_reason": {"type": "length"}}}
    step = {"name": "main", "response": {"status": 200, "content_type": "text/event-stream",
                                         "sse": [chunk, last, "[DONE]"]}}  # fmt: skip
    rec = {"case": "s", "main": "main", "steps": [step], "deterministic": ["response.sse.-1"]}
    act = copy.deepcopy(rec)
    act["steps"][0]["response"]["sse"] = [chunk, chunk, chunk, last, "[DONE]"]  # more chunks: fine
    assert compare_fixture(rec, act) == []
    act["steps"][0]["response"]["sse"] = [chunk, chunk]  # no final chunk, no [DONE]
    got = _kinds(compare_fixture(rec, act))
    assert ("main.response.sse.1.meta_info.finish_reason", "type") in got
    assert ("response.sse.-1", "value") in got

    info = {"name": "main", "response": {"status": 200, "content_type": "application/json",
                                         "json": {"version": "0.5.17", "tp_size": 1, "many": 1}}}  # fmt: skip
    rec = {"case": "i", "main": "main", "steps": [info], "shape_ignore": ["main.response.json"],
           "required": ["response.json.version", "response.json.tp_size"]}  # fmt: skip
    act = copy.deepcopy(rec)
    act["steps"][0]["response"]["json"] = {"version": "0.5.23", "tp_size": "1", "other": 2}
    assert _kinds(compare_fixture(rec, act)) == {("response.json.tp_size", "type")}

    def seeded(a: list[int], b: list[int]) -> dict:
        steps = [{"name": n, "response": {"status": 200, "content_type": "application/json", "json": {"ids": ids}}}
                 for n, ids in (("first", a), ("second", b))]  # fmt: skip
        return {"case": "seed", "main": "first", "steps": steps,
                "invariants": [{"equal": ["first.response.json.ids", "second.response.json.ids"]}]}  # fmt: skip

    assert compare_fixture(seeded([1, 2], [1, 2]), seeded([3, 4], [3, 4])) == []
    assert [d.kind for d in compare_fixture(seeded([1, 2], [1, 2]), seeded([3, 4], [3, 5]))] == ["invariant"]
    assert compare_fixture(seeded([1, 2], [1, 3]), seeded([3, 4], [3, 5])) == []  # SGLang itself broke it


def test_sse_middle_chunks_are_held_to_the_recorded_middle_and_the_first_to_the_first():
    first = {"text": "a", "meta_info": {"finish_reason": None, "sent_ts": 1.0}}  # SGLang marks the first chunk only
    middle = {"text": "ab", "meta_info": {"finish_reason": None}}
    last = {"text": "abc", "meta_info": {"finish_reason": {"type": "length"}, "e2e_latency": 0.1}}
    step = {"name": "main", "response": {"status": 200, "content_type": "text/event-stream",
                                         "sse": [first, middle, last, "[DONE]"]}}  # fmt: skip
    rec = {"case": "s", "main": "main", "steps": [step]}
    act = copy.deepcopy(rec)
    act["steps"][0]["response"]["sse"] = [first, middle, middle, middle, last, "[DONE]"]
    assert compare_fixture(rec, act) == []
    act["steps"][0]["response"]["sse"] = [middle, first, last, "[DONE]"]  # the mark on the wrong chunk
    assert _kinds(compare_fixture(rec, act)) == {
        ("main.response.sse.0.meta_info.sent_ts", "missing"),
        ("main.response.sse.1.meta_info.sent_ts", "extra"),
    }


def test_any_type_paths_must_be_present_but_may_change_type():
    rec = _generate_fixture()
    rec["any_type"] = ["response.json.meta_info.finish_reason"]
    act = copy.deepcopy(rec)
    _answer(act)["meta_info"]["finish_reason"] = None  # still running, say: another type, not a difference
    rec["deterministic"] = ["main.response.status"]
    assert compare_fixture(rec, act) == []
    del _answer(act)["meta_info"]["finish_reason"]
    assert _kinds(compare_fixture(rec, act)) == {("main.response.json.meta_info.finish_reason", "missing")}
    _answer(act)["meta_info"]["finish_reason"] = {"type": "length", "length": 3}
    _answer(act)["meta_info"]["e2e_latency"] = "slow"  # paths outside any_type keep their type check
    assert _kinds(compare_fixture(rec, act)) == {("main.response.json.meta_info.e2e_latency", "type")}


def test_a_step_that_errored_is_reported_and_one_recorded_as_failed_is_not_held():
    rec = _generate_fixture()
    act = copy.deepcopy(rec)
    act["steps"][0]["response"] = {"status": None, "error": "ReadTimeout"}
    assert ("main.response", "step") in _kinds(compare_fixture(rec, act))
    rec["steps"][0]["response"] = {"status": None, "error": "ConnectError"}
    assert compare_fixture(rec, _generate_fixture()) == []


def test_paths():
    root = {"a": {"b": [[1, 2], [3]]}, "s": "xyz"}
    assert resolve(root, "a.b.1.0") == [("a.b.1.0", 3)]
    assert resolve(root, "a.b.-1") == [("a.b.-1", [3])]
    assert resolve(root, "len(a.b.*)") == [("len(a.b.0)", 2), ("len(a.b.1)", 1)]
    assert resolve(root, "len(s)") == [("len(s)", 3)]
    assert resolve(root, "a.c.d") == [("a.c.d", MISSING)]
    assert [json_type(x) for x in (None, True, 1, 1.0, "", [], {})] == [
        "null", "bool", "int", "float", "str", "list", "object"
    ]  # fmt: skip
