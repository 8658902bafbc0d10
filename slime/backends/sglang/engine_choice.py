"""Which inference servers a run starts, decided and checked in the driver before Ray starts.

`--rollout-engine auto` never falls back to the simulated engines silently: it picks them only on a machine
without CUDA (a laptop, CI). On a CUDA machine a run with no SGLang to start stops at once and says how to ask
for the simulated engines; a GPU user who forgot to install SGLang must not train against them unawares.

Real SGLang runs under `--sglang-python` (default: slime's own interpreter): often a venv of its own, since
SGLang pins its own torch and transformers. That interpreter is asked which SGLang it imports (a subprocess, no
import here), and the flags the user set are checked against that release: by its own parser where it imports
(`live_parser.py`), else by the committed snapshot of the nearest release (`flags.check_release_flags`).
"""

from __future__ import annotations

import functools
import logging
import subprocess
import sys
from argparse import Namespace

from slime.backends.sglang import server_plugins
from slime.backends.sglang.flags import check_release_flags, sglang_overrides_from_args
from slime.backends.sglang.versions import protocol_for
from slime.utils.cuda import cuda_available
from slime.utils.errors import SlimeArgError

logger = logging.getLogger(__name__)

# found without importing it (SGLang's __init__ imports transformers and more: seconds), its runtime `srt` included
_PROBE = (
    "import importlib.metadata as m, importlib.util as u, os\n"
    "s = u.find_spec('sglang')\n"
    "ok = s is not None and any(os.path.isdir(os.path.join(p, 'srt')) for p in s.submodule_search_locations or ())\n"
    "print(m.version('sglang') if ok else '')"
)


def sglang_python(args: Namespace) -> str:
    """The interpreter that runs SGLang servers."""
    return args.sglang_python or sys.executable


@functools.cache
def installed_sglang(python: str) -> str | None:
    """The SGLang version `python` imports, None when it imports none (asked in a subprocess: the interpreter may
    be another venv's, and importing SGLang here would drag its torch into the driver)."""
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlimeArgError(f"--sglang-python {python}: cannot run it ({e})") from e
    if out.returncode != 0:
        raise SlimeArgError(f"--sglang-python {python}: exits {out.returncode}: {out.stderr.strip()[-300:]}")
    return out.stdout.strip() or None


def choose_rollout_engine(args: Namespace) -> tuple[str, str]:
    """('sglang' or a server plugin's name, why) for `--rollout-engine`; raises SlimeArgError when auto finds CUDA
    but no SGLang, or sglang finds no SGLang."""
    python = sglang_python(args)
    chosen = server_plugins.plugin(args.rollout_engine)
    if chosen is not None:
        return args.rollout_engine, f"{args.rollout_engine} servers (--rollout-engine {args.rollout_engine})"
    stand_in = server_plugins.stand_in()
    if args.rollout_engine == "auto" and not cuda_available():
        if stand_in is None:
            raise SlimeArgError(
                "--rollout-engine auto: this machine has no CUDA and no installed server plugin stands in for "
                "SGLang without it; pass --rollout-engine NAME"
            )
        return stand_in.name, f"{stand_in.name} servers (--rollout-engine auto: this machine has no CUDA)"
    version = installed_sglang(python)
    where = "slime's interpreter" if python == sys.executable else f"--sglang-python {python}"
    if args.rollout_engine == "sglang":
        if version is None:
            raise SlimeArgError(
                f"--rollout-engine sglang: SGLang is not importable by {where}; install it there, or point "
                "--sglang-python at an interpreter that has it"
            )
        return "sglang", f"SGLang {version} from {where} (--rollout-engine sglang)"
    if version is None:
        ask = f", or pass --rollout-engine {stand_in.name} to run its simulated servers" if stand_in else ""
        raise SlimeArgError(
            f"--rollout-engine auto: this machine has CUDA but SGLang is not importable by {where}; install SGLang "
            f"(or pass --sglang-python){ask}"
        )
    return "sglang", f"SGLang {version} from {where} (--rollout-engine auto: CUDA and SGLang found)"


def check_rollout_engine(args: Namespace) -> None:
    """Preflight: resolve `--rollout-engine` (written back as 'sglang' or the plugin's name, so every engine actor
    starts what was checked here) and check the SGLang release and its flags. Nothing to check where no server is
    launched (`--debug-train-only`, `--rollout-external`)."""
    if args.debug_train_only or args.rollout_external:
        return
    args.rollout_engine, why = choose_rollout_engine(args)
    if args.rollout_engine == "sglang":
        _check_release(args)
    logger.info("rollout engine: %s", why)  # once every check passed: an error stays the console's one line
    if args.rollout_engine == "sglang" and not args.sglang_enable_deterministic_inference:
        logger.info(
            "SGLang runs without --sglang-enable-deterministic-inference: it ignores sampling_seed, so a resumed run "
            "regenerates its in-flight prompts with other tokens"
        )


def _check_release(args: Namespace) -> None:
    python = sglang_python(args)
    version = installed_sglang(python)
    assert version is not None  # choose_rollout_engine refused otherwise
    args.sglang_version = version
    try:
        protocol_for(version)
    except ValueError as e:
        raise SlimeArgError(f"--sglang-python {python}: {e}") from e
    from slime.backends.sglang.live_parser import check_server_argvs
    from slime.backends.sglang.sglang_config import resolve_sglang_config

    check_release_flags(sglang_overrides_from_args(args), version)
    config = resolve_sglang_config(args)
    for model in config.models:
        for group in model.server_groups:
            where = f"{config.source or 'the topology'}: model {model.name} {group.worker_type} group"
            check_release_flags({str(k).replace("-", "_"): v for k, v in group.overrides.items()}, version, where)
    check_server_argvs(args, config, python, version)
