"""Snapshot SGLang's server CLI (`ServerArgs.add_cli_args`) into slime/backends/sglang/sglang_flags_<ver>.json.

Why: slime validates `--sglang-*` pass-through flags on machines where SGLang cannot be installed (CPU
laptops, CI's main venv). The snapshot is that parser, frozen per SGLang version. Run it inside the side
venv (ci/sglang_venv.sh), never the main one:

    .venv-sglang/bin/python scripts/gen_sglang_flags.py            # writes the snapshot
    .venv-sglang/bin/python scripts/gen_sglang_flags.py --stdout   # prints it (tests compare this)

The same `describe_parser` serialises the router's parser (scripts/gen_router_flags.py).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any

OUT_DIR = Path(__file__).resolve().parent.parent / "slime" / "backends" / "sglang"

# Custom argparse `type=` callables mapped to the value kind slime validates on its side. Anything else is
# recorded as "str" (slime passes the raw text and SGLang validates it at launch) with its name in type_fn.
_TYPE_KINDS = {
    "str": "str",
    "int": "int",
    "float": "float",
    "loads": "json",
    "json_list_type": "json",
    "parse_cuda_graph_config_arg": "json",
    "human_readable_int": "human_readable_int",
    "nullable_str": "nullable_str",
}
_BUILTIN_ACTIONS = {
    "_StoreAction": "store",
    "_StoreTrueAction": "store_true",
    "_StoreFalseAction": "store_false",
    "_StoreConstAction": "store_const",
    "_AppendAction": "append",
    "_AppendConstAction": "append_const",
    "_ExtendAction": "extend",
    "_CountAction": "count",
    "BooleanOptionalAction": "boolean_optional",
}


def _jsonable(value: Any) -> Any:
    """Defaults as JSON when they are plain data; anything else as {"repr": ...} so the file stays stable."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        try:
            json.dumps(value)
            return value
        except TypeError:
            pass
    return {"repr": repr(value)}


def _choices(choices: Any) -> list[Any] | None:
    # Some choice lists are built from sets, so their order changes between runs: sort them for a stable file.
    if choices is None:
        return None
    values = [_jsonable(c) for c in choices]
    return sorted(values, key=lambda v: json.dumps(v, sort_keys=True))


def describe_action(action: argparse.Action) -> dict[str, Any]:
    cls = type(action).__name__
    kind = _BUILTIN_ACTIONS.get(cls)
    if kind is None:
        # Project-specific actions (deprecation shims, LoRA paths): what matters to a pass-through is only
        # whether the option takes values, so a zero-arg one behaves like a flag and the rest like store.
        kind = "flag" if action.nargs == 0 else "store"
    fn = action.type
    fn_name = getattr(fn, "__name__", None) if fn is not None else None
    entry: dict[str, Any] = {
        "dest": action.dest,
        "option_strings": list(action.option_strings),
        "action": kind,
        "action_class": cls,
        "type": None if fn is None else _TYPE_KINDS.get(fn_name or "", "str"),
        "nargs": action.nargs,
        "choices": _choices(action.choices),
        "default": _jsonable(action.default),
        "required": bool(action.required),
        "help": None if action.help in (None, argparse.SUPPRESS) else str(action.help),
    }
    if fn is not None and fn_name not in ("str", "int", "float"):
        entry["type_fn"] = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn_name)}"
    if kind in ("store_const", "append_const", "flag") and action.const is not None:
        entry["const"] = _jsonable(action.const)
    if "deprecated" in cls.lower():
        entry["deprecated"] = True
    return entry


def describe_parser(parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    entries = [describe_action(a) for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    return sorted(entries, key=lambda e: (e["dest"], e["option_strings"]))


def dump(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def build_snapshot() -> dict[str, Any]:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    options = describe_parser(parser)
    return {
        "package": "sglang",
        "version": importlib.metadata.version("sglang"),
        "source": "sglang.srt.server_args.ServerArgs.add_cli_args",
        "generator": "scripts/gen_sglang_flags.py",
        "num_options": len(options),
        "options": options,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stdout", action="store_true", help="print the snapshot instead of writing it")
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR)
    ns = ap.parse_args(argv)
    text = dump(build_snapshot())
    if ns.stdout:
        sys.stdout.write(text)
        return 0
    version = json.loads(text)["version"]
    path = ns.out_dir / f"sglang_flags_{version}.json"
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
