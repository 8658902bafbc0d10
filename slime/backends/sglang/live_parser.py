"""The server argv slime builds, checked by the installed SGLang's own parser before anything starts.

Why beside the snapshots (flags.py): a snapshot records option names, kinds and choices, not SGLang's own value
validators (e.g. `--cuda-graph-backend-decode`'s), and a user's SGLang may be a release without a committed
snapshot. Where `--sglang-python` imports SGLang, one subprocess parses every server group's argv with
`ServerArgs.add_cli_args` (argparse only: `ServerArgs.__post_init__` probes the GPU and is left to launch), so a
bad value fails the run in the driver with SGLang's own words.
"""

from __future__ import annotations

import json
import logging
import subprocess
from argparse import Namespace

from slime.backends.sglang.server_args import build_server_argv
from slime.backends.sglang.sglang_config import SGLangConfig
from slime.utils.errors import SlimeArgError

logger = logging.getLogger(__name__)

_PARSE = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs

class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)

out = []
for argv in json.load(sys.stdin):
    parser = Parser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    try:
        parser.parse_args(argv)
        out.append(None)
    except (ValueError, argparse.ArgumentError) as e:
        out.append(str(e))
print(json.dumps(out))
"""


def group_argvs(args: Namespace, config: SGLangConfig) -> dict[str, list[str]]:
    """One representative server argv per server group (placeholder ports; engine 0 of the group), without the
    interpreter and module: what `python -m sglang.launch_server` receives."""
    out: dict[str, list[str]] = {}
    port = 30000
    for model in config.models:
        for group in model.server_groups:
            if group.is_placeholder:
                continue
            argv = build_server_argv(
                args, backend="sglang", host="127.0.0.1", port=port, num_gpus=group.num_gpus_per_engine,
                nccl_port=port + 1, worker_type=group.worker_type,
                bootstrap_port=port + 2 if group.worker_type == "prefill" else None,
                overrides=group.overrides, model_path=group.model_path,
            )  # fmt: skip
            out[f"model {model.name}, {group.worker_type} group"] = argv[3:]  # drop `python -m sglang.launch_server`
            port += 3
    return out


def check_server_argvs(args: Namespace, config: SGLangConfig, python: str, version: str) -> None:
    """Raise SlimeArgError with SGLang's message for the first server group whose argv its parser refuses."""
    argvs = group_argvs(args, config)
    if not argvs:
        return
    try:
        out = subprocess.run(
            [python, "-c", _PARSE], input=json.dumps(list(argvs.values())), capture_output=True, text=True,
            timeout=300, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlimeArgError(f"--sglang-python {python}: could not run SGLang's parser ({e})") from e
    if out.returncode != 0:
        raise SlimeArgError(
            f"--sglang-python {python}: SGLang {version}'s parser did not load: {out.stderr.strip()[-400:]}"
        )
    for where, error in zip(argvs, json.loads(out.stdout.strip().splitlines()[-1]), strict=True):
        if error is not None:
            raise SlimeArgError(f"SGLang {version} refuses the server flags of {where}: {error}")
    logger.info("server flags of %d group(s) accepted by SGLang %s's own parser", len(argvs), version)
