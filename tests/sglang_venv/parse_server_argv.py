"""Runs INSIDE the SGLang side venv (.venv-sglang): parse argv lists with SGLang's own CLI and report fields.

Why a script and not a pytest module: the side venv has SGLang but neither slime nor pytest. The main-venv
test (tests/unit/test_server_args.py) builds the argv with slime, pipes it here as JSON and asserts on the
ServerArgs fields printed back. Input (stdin): {"case name": ["python", "-m", "sglang.launch_server", ...]}.
Output (stdout): {"case name": {"fields": {...}} or {"error": "..."}}. `--with-snapshot` adds the flag snapshot
`scripts/gen_sglang_flags.py --stdout` prints, as the string "__snapshot__" (one SGLang import for both tests).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from typing import Any


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def parse(argv: list[str]) -> dict[str, Any]:
    from msgspec.structs import fields
    from sglang.srt.server_args import ServerArgs

    if argv[1:3] != ["-m", "sglang.launch_server"]:
        return {"error": f"not a sglang.launch_server command: {argv[:3]}"}
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(argv[3:])  # unknown flags or bad values exit(2) here
    except SystemExit:
        return {"error": err.getvalue().strip().splitlines()[-1]}
    out: dict[str, Any] = {"namespace": {k: _jsonable(v) for k, v in vars(ns).items()}}
    try:
        server_args = ServerArgs.from_cli_args(ns)
    except Exception as e:  # noqa: BLE001 - report SGLang's own validation error to the caller
        out["from_cli_args_error"] = f"{type(e).__name__}: {e}"
        return out
    out["fields"] = {f.name: _jsonable(getattr(server_args, f.name)) for f in fields(ServerArgs)}
    return out


def snapshot_text() -> str:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "gen_sglang_flags.py"
    spec = importlib.util.spec_from_file_location("gen_sglang_flags", path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen.dump(gen.build_snapshot())


def main() -> int:
    cases = json.load(sys.stdin)
    result: dict[str, Any] = {name: parse(argv) for name, argv in cases.items()}
    if "--with-snapshot" in sys.argv[1:]:
        result["__snapshot__"] = snapshot_text()
    sys.stdout.write(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
