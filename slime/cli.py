"""`slime` command line: `slime train | plan | gateway`.

User mistakes print one line (`slime: error: ...`) and exit 2, with no traceback; `SLIME_DEBUG=1` shows it.
"""

from __future__ import annotations

import logging
import os
import sys

from slime.utils.errors import SlimeArgError

USAGE = "usage: slime {train,plan,gateway} [flags]   (slime train --help lists the flags)"


def _configure_logging() -> None:
    logging.basicConfig(
        level=os.environ.get("SLIME_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "train" and "--help-sglang" in rest:
            from slime.backends.sglang.flags import sglang_flags_help

            print(sglang_flags_help())
            return 0
        if command == "train":
            from slime.arguments import parse_args

            args = parse_args(rest)
            _configure_logging()
            from slime.train import train

            train(args)
            return 0
        if command == "plan":
            from slime.plan_cli import main as plan_main

            return plan_main(rest)
        if command == "gateway":
            from slime.agent.gateway_cli import main as gateway_main

            return gateway_main(rest)
        raise SlimeArgError(f"unknown command {command!r}; {USAGE}")
    except SlimeArgError as e:
        if os.environ.get("SLIME_DEBUG"):
            raise
        print(f"slime: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
