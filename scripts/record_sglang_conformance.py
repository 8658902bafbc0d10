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
from scripts.sglang_conformance_cases import REQUEST_TIMEOUT_S, RUN_DEADLINE_S, VOCAB_GUESS, serving_cases  # noqa: E402
from scripts.sglang_conformance_control import control_cases  # noqa: E402
from sim.fake_sglang.conformance import DONE, check_invariants  # noqa: E402 - pure stdlib

logger = logging.getLogger(__name__)


def build_cases(vocab_size: int, torch_payloads: dict[str, str | None]) -> list[dict]:
    """The fixed, ordered list: the serving cases, then those that change the server. `torch_payloads`: base64
    pickles that need torch to build (None: unavailable)."""
    return [*serving_cases(vocab_size), *control_cases(torch_payloads)]


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
