"""Snapshot sglang-router's CLI (`python -m sglang_router.launch_router`) into router_flags_<ver>.json.

Why: `--router-*` pass-through flags are validated against this file, and a router upgrade shows up as a
reviewable diff. Runs in the MAIN venv (sglang-router is a dependency there):

    .venv/bin/python scripts/gen_router_flags.py            # writes the snapshot
    .venv/bin/python scripts/gen_router_flags.py --stdout   # prints it (tests compare this)

The parser is built the way sglang_router/launch_router.py:parse_router_args builds it:
`RouterArgs.add_cli_args(parser, use_router_prefix=False)`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_sglang_flags import OUT_DIR, describe_parser, dump  # noqa: E402


def build_snapshot() -> dict[str, Any]:
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(add_help=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    options = describe_parser(parser)
    return {
        "package": "sglang-router",
        "version": importlib.metadata.version("sglang-router"),
        "source": "sglang_router.router_args.RouterArgs.add_cli_args(use_router_prefix=False)",
        "generator": "scripts/gen_router_flags.py",
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
    path = ns.out_dir / f"router_flags_{json.loads(text)['version']}.json"
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
