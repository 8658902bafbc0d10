"""`slime` command line: `slime train | plan | gateway`.

User mistakes print one line (`slime: error: ...`) and exit 2, with no traceback; `SLIME_DEBUG=1` shows it.
"""

from __future__ import annotations

import os
import sys
from argparse import Namespace

from slime.utils.errors import SlimeArgError

USAGE = "usage: slime {train,plan,gateway,inspect} [flags]   (slime train --help lists the flags)"


def _run_failed(e: BaseException, args: Namespace) -> int:
    """A failure inside the run (an actor, an engine, the router): its own message in full, not the layers of
    Ray wrapping around it, and where the logs are."""
    cause = getattr(e, "cause", None) or e  # a RayTaskError carries the actor's exception
    print(f"slime: error: {type(cause).__name__}: {cause}", file=sys.stderr)
    metrics_dir = args.metrics_dir
    if metrics_dir:
        print(
            f"slime: logs of the run's processes: {metrics_dir}/logs/ (actors), {metrics_dir}/servers/ (engines, "
            "routers); SLIME_DEBUG=1 shows the traceback",
            file=sys.stderr,
        )
    return 1


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
            from slime.utils.console import configure_driver

            configure_driver(args.log_level)
            if args.max_restarts:  # a supervisor of fresh driver processes (slime/ray/restarts.py)
                from slime.ray.restarts import supervise

                return supervise(rest, args)
            from slime.ray.actor_faults import ActorFault
            from slime.ray.restarts import EXIT_FAULT
            from slime.train import train

            try:
                train(args)
            except SlimeArgError:
                raise
            except ActorFault as e:  # one line: the actor, the fault, the checkpoint to resume from
                if os.environ.get("SLIME_DEBUG"):
                    raise
                print(f"slime: error: {e.line()}", file=sys.stderr)
                return EXIT_FAULT
            except KeyboardInterrupt:  # a stop asked for (Ctrl-C, or a driving script): the run was shut down
                print("slime: interrupted; every process of the run was stopped", file=sys.stderr)
                return 130
            except Exception as e:
                if os.environ.get("SLIME_DEBUG"):
                    raise
                return _run_failed(e, args)
            return 0
        if command == "inspect":
            from slime.inspect_cli import main as inspect_main

            return inspect_main(rest)
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
