"""Conformance fixtures: request/response pairs recorded from a real SGLang server, and the comparer that checks
another server's answers (the fake's) against them. Pure stdlib: the recorder (scripts/record_sglang_conformance.py)
imports it on a GPU host that has nothing of slime's environment.

A fixture (one JSON file per case)::

    {"case": "generate_logprob", "why": "...",
     "request": {...}, "response": {...},          # the main step, repeated from `steps` for the reader
     "main": "main",
     "steps": [{"name": "main", "request": {"method", "path", "query", "body" | "raw_body"},
                "background": false, "delay_s": 0.0, "timeout_s": 20.0,
                "response": {"status", "content_type", "json" | "text", "sse"?, "elapsed_s", "error"?}}, ...],
     "deterministic": ["response.status", "len(response.json.output_ids)", ...],
     "invariants": [{"equal": ["first.response.json.output_ids", "second.response.json.output_ids"]}],
     "shape_ignore": ["response.json"],             # subtrees compared by presence and type only, not their keys
     "any_type": ["response.json.choices.*.matched_stop"],  # present, of whatever type (it follows the values)
     "required": ["response.json.version"]}         # paths that must be present (with the recorded type)

Paths are dotted and rooted at a view of the fixture: ``request`` / ``response`` (the main step) and each step by
its name (``background.response.json.meta_info.finish_reason.type``). A component is a key, a list index (negative
counts from the end) or ``*`` (every element); ``len(PATH)`` is the length of the list or string at PATH.

What the comparer checks, per step: the status code and the media type; then the recorded body's every field is
present in the answer with the same JSON type (int, float, bool, str, null, list, object are all distinct);
lists are compared element by element (an element past the recorded ones against the last recorded one) and a
list whose elements have different types (a tuple such as ``[logprob, token_id, text]``) must have the recorded
length; a recorded non-empty list answered empty is reported. Keys the answer has beyond the recorded ones are
reported as ``extra``. A path under ``any_type`` must be present but may hold any JSON type (a field whose type
follows the values, such as a chat choice's ``matched_stop``: a token id, a stop string or null). SSE answers
(``sse``: the parsed ``data:`` payloads) are compared chunk by chunk: the first JSON chunk against the recorded
first, the last against the recorded last, every one between against the recorded second (SGLang's first chunk
carries fields the later ones do not: ``response_sent_to_client_ts``), and the ``[DONE]`` tail.
Then the values at the deterministic paths must be equal, and the invariants must hold in the answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MISSING = object()  # a path that does not resolve
DONE = "[DONE]"
_LEN = re.compile(r"^len\((.+)\)$")


@dataclass(frozen=True)
class Difference:
    """One way the answer differs from the recording. kind: missing | extra | type | length | empty | value |
    invariant | step | media_type."""

    case: str
    path: str
    kind: str
    expected: Any = None
    actual: Any = None

    def __str__(self) -> str:
        return f"{self.case}: {self.path}: {self.kind} (recorded {_short(self.expected)}, got {_short(self.actual)})"


def _short(x: Any, limit: int = 160) -> str:
    if x is MISSING:
        return "<absent>"
    s = json.dumps(x, default=str) if not isinstance(x, str) else repr(x)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def json_type(x: Any) -> str:
    """The JSON type of a decoded value; int and float are distinct, bool is not an int."""
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int):
        return "int"
    if isinstance(x, float):
        return "float"
    if isinstance(x, str):
        return "str"
    if isinstance(x, list):
        return "list"
    if isinstance(x, dict):
        return "object"
    return type(x).__name__


def fixture_view(fixture: dict[str, Any]) -> dict[str, Any]:
    """The object paths are resolved in: each step by name, plus `request`/`response` of the main step."""
    steps = {s["name"]: s for s in fixture.get("steps", [])}
    main = steps.get(fixture.get("main", "main"), {})
    return {**steps, "request": main.get("request"), "response": main.get("response")}


def split_path(path: str) -> list[str]:
    return [p for p in path.split(".") if p != ""]


def resolve(root: Any, path: str) -> list[tuple[str, Any]]:
    """Every concrete (path, value) the path names (`*` fans out); a missing node gives (path, MISSING).
    `len(P)` gives the length of each value P names (MISSING where P is absent or has no length)."""
    m = _LEN.match(path.strip())
    if m:
        out = []
        for p, val in resolve(root, m.group(1)):
            out.append((f"len({p})", len(val) if isinstance(val, (list, str, dict)) else MISSING))
        return out
    nodes: list[tuple[list[str], Any]] = [([], root)]
    for comp in split_path(path):
        nxt: list[tuple[list[str], Any]] = []
        for prefix, node in nodes:
            if node is MISSING:
                nxt.append((prefix + [comp], MISSING))
            elif comp == "*":
                if isinstance(node, list):
                    nxt.extend((prefix + [str(i)], v) for i, v in enumerate(node))
                elif isinstance(node, dict):
                    nxt.extend((prefix + [str(k)], v) for k, v in node.items())
                else:
                    nxt.append((prefix + [comp], MISSING))
            elif isinstance(node, dict):
                nxt.append((prefix + [comp], node.get(comp, MISSING)))
            elif isinstance(node, list) and re.fullmatch(r"-?\d+", comp):
                i = int(comp)
                ok = -len(node) <= i < len(node)
                nxt.append((prefix + [comp], node[i] if ok else MISSING))  # as written: -1 is the last on both sides
            else:
                nxt.append((prefix + [comp], MISSING))
        nodes = nxt
    return [(".".join(p), v) for p, v in nodes]


def _matches(pattern: str, path: str) -> bool:
    pp, cp = split_path(pattern), split_path(path)
    return len(pp) == len(cp) and all(a == "*" or a == b for a, b in zip(pp, cp, strict=True))


def _is_tuple(xs: list[Any]) -> bool:
    return len({json_type(x) for x in xs}) > 1


class _Shape:
    def __init__(self, case: str, ignore: list[str], any_type: list[str] | None = None) -> None:
        self.case, self.ignore, self.any_type, self.diffs = case, ignore, any_type or [], []

    def add(self, path: str, kind: str, expected: Any = None, actual: Any = None) -> None:
        self.diffs.append(Difference(self.case, path, kind, expected, actual))

    def compare(self, expected: Any, actual: Any, path: str) -> None:
        if any(_matches(p, path) for p in self.any_type):
            return  # present (the caller checked), of any type
        te, ta = json_type(expected), json_type(actual)
        if te != ta:
            self.add(path, "type", te, ta)
            return
        if any(_matches(p, path) for p in self.ignore):
            return
        if te == "object":
            for k, v in expected.items():
                if k not in actual:
                    self.add(f"{path}.{k}", "missing", v, MISSING)
                else:
                    self.compare(v, actual[k], f"{path}.{k}")
            for k in actual:
                if k not in expected:
                    self.add(f"{path}.{k}", "extra", MISSING, actual[k])
        elif te == "list":
            if not expected:
                return
            if not actual:
                self.add(path, "empty", len(expected), 0)
                return
            if _is_tuple(expected) and len(expected) != len(actual):
                self.add(f"len({path})", "length", len(expected), len(actual))
            for i, a in enumerate(actual):
                if _is_tuple(expected) and i >= len(expected):
                    break
                self.compare(expected[min(i, len(expected) - 1)], a, f"{path}.{i}")


def _media(ct: Any) -> Any:
    return ct.split(";")[0].strip().lower() if isinstance(ct, str) else ct


def compare_response(
    case: str,
    prefix: str,
    expected: dict[str, Any],
    actual: dict[str, Any],
    ignore: list[str],
    any_type: list[str] | None = None,
) -> list[Difference]:
    """Shape of one step's answer (`prefix`: the step's name, paths are `<prefix>.response....`)."""
    s = _Shape(case, ignore, any_type)
    base = f"{prefix}.response"
    if "error" in expected:  # the recording itself failed: nothing to hold the answer to
        return []
    if "error" in actual:
        s.add(base, "step", expected.get("status"), f"error: {actual['error']}")
        return s.diffs
    if expected.get("status") != actual.get("status"):
        s.add(f"{base}.status", "value", expected.get("status"), actual.get("status"))
    if _media(expected.get("content_type")) != _media(actual.get("content_type")):
        s.add(f"{base}.content_type", "media_type", expected.get("content_type"), actual.get("content_type"))
    if "sse" in expected:
        if "sse" not in actual:
            s.add(f"{base}.sse", "missing", "SSE chunks", MISSING)
        else:
            _compare_sse(s, expected["sse"], actual["sse"], f"{base}.sse")
        return s.diffs
    for key in ("json", "text"):
        if key in expected:
            if key not in actual:
                s.add(f"{base}.{key}", "missing", json_type(expected[key]), MISSING)
            else:
                s.compare(expected[key], actual[key], f"{base}.{key}")
        elif key in actual:
            s.add(f"{base}.{key}", "extra", MISSING, json_type(actual[key]))
    return s.diffs


def _compare_sse(s: _Shape, expected: list[Any], actual: list[Any], path: str) -> None:
    exp_json = [c for c in expected if c != DONE]
    act_json = [(i, c) for i, c in enumerate(actual) if c != DONE]
    if (expected[-1:] == [DONE]) != (actual[-1:] == [DONE]):
        s.add(f"{path}.-1", "value", expected[-1] if expected else MISSING, actual[-1] if actual else MISSING)
    if not exp_json:
        return
    if not act_json:
        s.add(path, "empty", len(exp_json), 0)
        return
    middle = exp_json[1] if len(exp_json) > 2 else exp_json[0]
    for n, (i, chunk) in enumerate(act_json):
        ref = exp_json[-1] if n == len(act_json) - 1 else exp_json[0] if n == 0 else middle
        s.compare(ref, chunk, f"{path}.{i}")


def _values(fixture: dict[str, Any], path: str) -> dict[str, Any]:
    return dict(resolve(fixture_view(fixture), path))


def check_invariants(fixture: dict[str, Any]) -> list[Difference]:
    """The fixture's own invariants, evaluated on its responses (a recording's or a replay's)."""
    diffs = []
    for inv in fixture.get("invariants", []):
        a, b = inv["equal"]
        va, vb = [v for _, v in resolve(fixture_view(fixture), a)], [v for _, v in resolve(fixture_view(fixture), b)]
        if va != vb or any(v is MISSING for v in va + vb):
            diffs.append(Difference(fixture["case"], f"{a} == {b}", "invariant", va, vb))
    return diffs


def compare_fixture(recorded: dict[str, Any], actual: dict[str, Any]) -> list[Difference]:
    """Every difference between a recorded fixture and another server's run of the same steps."""
    case = recorded["case"]
    main = recorded.get("main", "main")
    ignore = [_by_step(p, main) for p in recorded.get("shape_ignore", [])]
    any_type = [_by_step(p, main) for p in recorded.get("any_type", [])]
    diffs: list[Difference] = []
    act_steps = {s["name"]: s for s in actual.get("steps", [])}
    failed = set()
    for step in recorded.get("steps", []):
        name = step["name"]
        if name not in act_steps or "response" not in act_steps[name]:
            diffs.append(Difference(case, name, "step", "ran", "not run"))
            failed.add(name)
            continue
        diffs.extend(compare_response(case, name, step["response"], act_steps[name]["response"], ignore, any_type))
        if "error" in step["response"]:
            failed.add(name)
    view_rec, view_act = fixture_view(recorded), fixture_view(actual)
    for path in recorded.get("required", []):
        for p, v in resolve(view_rec, path):
            av = dict(resolve(view_act, p)).get(p, MISSING)
            if v is not MISSING and av is MISSING:
                diffs.append(Difference(case, p, "missing", json_type(v), MISSING))
            elif v is not MISSING and json_type(v) != json_type(av):
                diffs.append(Difference(case, p, "type", json_type(v), json_type(av)))
    for path in recorded.get("deterministic", []):
        if split_path(_by_step(_LEN.sub(r"\1", path), main))[0] in failed:
            continue
        rec = dict(resolve(view_rec, path))
        act = dict(resolve(view_act, path))
        for p in sorted(set(rec) | set(act)):
            rv, av = rec.get(p, MISSING), act.get(p, MISSING)
            if rv != av:
                kind = "missing" if av is MISSING else "extra" if rv is MISSING else "value"
                diffs.append(Difference(case, p, kind, rv, av))
    held = {json.dumps(i["equal"]) for i in recorded.get("invariants", [])} - {
        json.dumps(d.path.split(" == ")) for d in check_invariants(recorded)
    }  # an invariant the recording itself breaks is a finding about SGLang, not asked of the answer
    diffs.extend(d for d in check_invariants(actual) if json.dumps(d.path.split(" == ")) in held)
    return _dedupe(diffs)


def _by_step(path: str, main: str) -> str:
    """`response...` / `request...` (the main step's) as `<main>.response...`."""
    return f"{main}.{path}" if split_path(path)[:1] in (["request"], ["response"]) else path


def _dedupe(diffs: list[Difference]) -> list[Difference]:
    seen, out = set(), []
    for d in diffs:
        key = (d.path, d.kind)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def load_fixture_dir(directory: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """index.json and the fixtures it lists, in recording order."""
    d = Path(directory)
    index = json.loads((d / "index.json").read_text())
    fixtures = [json.loads((d / f"{c}.json").read_text()) for c in index["cases"]]
    return index, fixtures
