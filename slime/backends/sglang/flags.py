"""`--sglang-*` and `--router-*` pass-through flags, validated against committed snapshots of the real parsers.

Why snapshots: SGLang cannot be installed where slime is usually parsed (CPU laptops, CI's main venv), yet a
typo in a pass-through flag must fail in the driver, before Ray starts, not minutes later inside an engine.
`scripts/gen_sglang_flags.py` / `scripts/gen_router_flags.py` freeze `ServerArgs.add_cli_args` and the
router's CLI per version; tests compare the snapshots with the live parsers.

Several SGLang releases are spoken (versions.py): the parser accepts the flags of every committed snapshot (a
dest's newest form wins), and the run's preflight checks the flags the user set against the release its servers
will run (`check_release_flags`; the live parser itself where SGLang is importable: `live_parser.py`).

Every snapshot option is re-registered with a prefix and `default=None`, so `args.sglang_<dest>` is None
exactly when the user did not set it, and only user choices are forwarded to SGLang.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import re
from collections.abc import Iterable
from decimal import Decimal
from functools import cache
from importlib import resources
from typing import Any

from slime.utils.errors import SlimeArgError

logger = logging.getLogger(__name__)

SGLANG_SNAPSHOT_VERSIONS = ("0.5.17", "0.5.23")  # oldest first; regenerate with scripts/gen_sglang_flags.py
SGLANG_VERSION = SGLANG_SNAPSHOT_VERSIONS[-1]  # the newest: the fake's release, and the default for checks
ROUTER_VERSION = "0.3.2"
SGLANG_SNAPSHOT = f"sglang_flags_{SGLANG_VERSION}.json"
ROUTER_SNAPSHOT = f"router_flags_{ROUTER_VERSION}.json"

# ServerArgs dests slime sets or controls itself for every engine (most in server_args.py:_slime_settings), so
# `--sglang-<name>` is refused for them.
SKIPPED_SGLANG_FLAGS: frozenset[str] = frozenset(
    {
        "model_path",
        "config",
        "trust_remote_code",
        "random_seed",
        "enable_memory_saver",
        "tp_size",
        "port",
        "host",
        "nnodes",
        "node_rank",
        "dist_init_addr",
        "gpu_id_step",
        "base_gpu_id",
        "nccl_port",
        "skip_server_warmup",
        "enable_return_routed_experts",
    }
)
# Where the value of a skipped flag comes from, for the error message.
_SLIME_SOURCE = {
    "model_path": "--hf-checkpoint (or `model_path` in --sglang-config)",
    "tp_size": "--rollout-num-gpus-per-engine divided by --sglang-pp-size",
    "random_seed": "--seed (plus the engine rank)",
    "enable_memory_saver": "--offload-rollout",
    "config": "--sglang-config",
}
# Of the skipped dests, those a --sglang-config group may still override (the rest would break placement).
OVERRIDABLE_SKIPPED: frozenset[str] = frozenset(
    {"model_path", "trust_remote_code", "random_seed", "enable_memory_saver", "skip_server_warmup"}
)

# slime's own --sglang-* flags: they configure slime's side of the connection, not the server.
SLIME_SGLANG_FLAGS: dict[str, dict[str, Any]] = {
    "sglang_router_ip": {"default": None, "help": "reuse an existing router at this address"},
    "sglang_router_port": {"type": int, "default": None, "help": "port of the existing router"},
    "sglang_router_request_timeout_secs": {
        "type": int,
        "default": 14400,
        "help": "the router's per-request timeout (long rollouts stream for hours)",
    },
    "sglang_python": {
        "default": None,
        "help": "interpreter that runs the SGLang servers (default: slime's own), e.g. a venv of SGLang's own or "
        "the offline pack's .sgl-site/bin/python; the run checks before start which SGLang it imports",
    },
    "sglang_server_concurrency": {
        "type": int,
        "default": 512,
        "help": "max in-flight requests per engine from the rollout side",
    },
}

# Router dests slime sets when it launches the router (router.py:build_router_argv).
SKIPPED_ROUTER_FLAGS: frozenset[str] = frozenset(
    {"host", "port", "worker_urls", "pd_disaggregation", "prefill", "decode", "request_timeout_secs"}
)
_ROUTER_SOURCE = {
    "request_timeout_secs": "--sglang-router-request-timeout-secs",
    "worker_urls": "the engines slime launches (registered through POST /workers)",
    "pd_disaggregation": "prefill/decode groups in --sglang-config",
}
# slime's policy name for header affinity and the 0.3.2 policy that implements it (docs/router.md).
ROUTER_POLICY_ALIASES = {"consistent_hashing": "manual"}
_POLICY_DESTS = ("policy", "prefill_policy", "decode_policy")


@cache
def _load(name: str) -> dict[str, Any]:
    return json.loads(resources.files(__package__).joinpath(name).read_text())


def load_sglang_snapshot(version: str = SGLANG_VERSION) -> dict[str, Any]:
    """One release's ServerArgs CLI (`{"version", "options": [...]}`); cached, treat as read-only."""
    return _load(f"sglang_flags_{version}.json")


def snapshot_version_for(version: str) -> str:
    """The committed snapshot that stands for `version`: the newest one not newer than it (the oldest for older
    releases, which versions.py refuses anyway)."""
    from slime.backends.sglang.versions import release

    older = [v for v in SGLANG_SNAPSHOT_VERSIONS if release(v) <= release(version)]
    return older[-1] if older else SGLANG_SNAPSHOT_VERSIONS[0]


def load_router_snapshot() -> dict[str, Any]:
    """sglang-router's launch_router CLI; cached, treat as read-only."""
    return _load(ROUTER_SNAPSHOT)


@cache
def sglang_options_by_dest(version: str | None = None) -> dict[str, dict[str, Any]]:
    """dest -> option of one release's snapshot, or (None) of every snapshot, a dest's newest form winning."""
    if version is not None:
        return {o["dest"]: o for o in load_sglang_snapshot(version)["options"]}
    out: dict[str, dict[str, Any]] = {}
    for v in SGLANG_SNAPSHOT_VERSIONS:
        out.update(sglang_options_by_dest(v))
    return out


@cache
def _all_sglang_options() -> tuple[dict[str, Any], ...]:
    """Every option of every committed snapshot to register, newest release first: an older release's option
    keeps only the option strings no newer one registers (argparse refuses a string twice; a dest may have several
    options, deprecated aliases among them)."""
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    for version in reversed(SGLANG_SNAPSHOT_VERSIONS):
        for opt in load_sglang_snapshot(version)["options"]:
            strings = [s for s in opt["option_strings"] if s not in seen]
            if strings:
                seen.update(strings)
                out.append(opt if len(strings) == len(opt["option_strings"]) else {**opt, "option_strings": strings})
    return tuple(out)


@cache
def router_options_by_dest() -> dict[str, dict[str, Any]]:
    return {o["dest"]: o for o in load_router_snapshot()["options"]}


# ---------------------------------------------------------------- value types (mirror SGLang's validators)


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from e


_json_value.__name__ = "JSON"

_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?")
_SUFFIX = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _human_int(text: str) -> int:
    """SGLang's human_readable_int (sglang/srt/utils/common.py): 4096, 32k, 1.5M, 2Ki (IEC: integers only)."""
    m = _HUMAN_INT.fullmatch(text.strip())
    if not m or (m.group(2) and m.group(2).endswith("i") and "." in m.group(1)):
        raise argparse.ArgumentTypeError(f"expected an integer like 4096, 32k or 2Ki, got {text!r}")
    number, suffix = m.groups()
    if suffix is None:
        if "." in number:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
        return int(number)
    return int(Decimal(number) * _SUFFIX[suffix])


_human_int.__name__ = "integer"

_TYPES: dict[str | None, Any] = {
    None: None,
    "str": str,
    "nullable_str": str,
    "int": int,
    "float": float,
    "json": _json_value,
    "human_readable_int": _human_int,
}


class _BooleanPairAction(argparse.Action):
    """`--sglang-x` / `--sglang-no-x` for SGLang's BooleanOptionalAction options (True / False, None if unset)."""

    def __init__(self, option_strings: list[str], dest: str, negatives: Iterable[str] = (), **kwargs: Any) -> None:
        self.negatives = frozenset(negatives)
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        setattr(namespace, self.dest, option_string not in self.negatives)


def _register(group: argparse._ArgumentGroup, opt: dict[str, Any], prefix: str, help_extra: str = "") -> None:
    names = [f"--{prefix}-{s.lstrip('-')}" for s in opt["option_strings"]]
    kind = opt["action"]
    kw: dict[str, Any] = {"dest": f"{prefix}_{opt['dest']}", "default": None}
    text = opt.get("help") or ""
    kw["help"] = (text.replace("%", "%%") + help_extra) or None
    if kind == "boolean_optional":
        negatives = [n for n, s in zip(names, opt["option_strings"], strict=True) if s.startswith("--no-")]
        group.add_argument(*names, action=_BooleanPairAction, negatives=negatives, **kw)
        return
    if kind in ("store_true", "flag"):
        group.add_argument(*names, action="store_true", **kw)
        return
    if kind == "store_false":
        group.add_argument(*names, action="store_false", **kw)
        return
    if kind in ("store_const", "append_const"):
        group.add_argument(*names, action=kind, const=opt.get("const", True), **kw)
        return
    if kind == "count":
        group.add_argument(*names, action="count", **kw)
        return
    action = kind if kind in ("append", "extend") else "store"
    kw["type"] = _TYPES.get(opt["type"], str)
    if opt["nargs"] is not None:
        kw["nargs"] = opt["nargs"]
    if opt["choices"] is not None:
        kw["choices"] = opt["choices"]
        kw["metavar"] = "{" + ",".join(map(str, opt["choices"])) + "}"
    group.add_argument(*names, action=action, **kw)


def add_sglang_arguments(parser: argparse.ArgumentParser) -> None:
    """Register every SGLang server flag as `--sglang-<name>` (dest `sglang_<dest>`), plus slime's own."""
    group = parser.add_argument_group(
        f"SGLang server flags of releases {', '.join(SGLANG_SNAPSHOT_VERSIONS)} (pass-through; see SGLang's docs)",
        "Forwarded to every engine, and checked before start against the release the servers run. slime sets "
        + ", ".join(sorted(SKIPPED_SGLANG_FLAGS))
        + " itself.",
    )
    own = parser.add_argument_group("SGLang connection (slime)")
    for dest, kw in SLIME_SGLANG_FLAGS.items():
        own.add_argument("--" + dest.replace("_", "-"), dest=dest, **kw)
    for opt in _all_sglang_options():
        if opt["dest"] in SKIPPED_SGLANG_FLAGS or f"sglang_{opt['dest']}" in SLIME_SGLANG_FLAGS:
            continue
        _register(group, opt, "sglang")


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    """Register sglang-router's flags as `--router-<name>` (dest `router_<dest>`), defaults None."""
    snap = load_router_snapshot()
    group = parser.add_argument_group(f"sglang-router {snap['version']} flags (pass-through)")
    for opt in snap["options"]:
        if opt["dest"] in SKIPPED_ROUTER_FLAGS:
            continue
        if opt["dest"] in _POLICY_DESTS and opt["choices"] is not None:
            opt = {**opt, "choices": [*opt["choices"], *ROUTER_POLICY_ALIASES]}
            extra = " consistent_hashing: session affinity on the X-SMG-Routing-Key header (runs 0.3.2's manual)."
            _register(group, opt, "router", help_extra=extra)
            continue
        _register(group, opt, "router")


# ---------------------------------------------------------------- rendering values back to argv


def _token(value: Any) -> str:
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def render_option(opt: dict[str, Any], value: Any) -> list[str]:
    """argv tokens setting one snapshot option to `value`, in the form the real parser expects."""
    names = opt["option_strings"]
    positive = next(s for s in names if not s.startswith("--no-"))
    kind, nargs = opt["action"], opt["nargs"]
    if kind == "boolean_optional":
        negative = next((s for s in names if s.startswith("--no-")), None)
        return [positive] if value else ([negative] if negative else [])
    if kind in ("store_true", "flag", "store_const"):
        return [positive] if value else []
    if kind == "store_false":
        return [] if value else [positive]
    if kind == "count":
        return [positive] * int(value)
    if kind in ("append", "extend"):
        out: list[str] = []
        for item in value if isinstance(value, (list, tuple)) else [value]:
            many = nargs not in (None, "?") and isinstance(item, (list, tuple))
            out += [positive, *(map(_token, item) if many else [_token(item)])]
        return out
    if nargs in (None, "?") or (opt["type"] == "json" and not isinstance(value, (list, tuple))):
        return [positive, _token(value)]
    items = value if isinstance(value, (list, tuple)) else [value]
    return [positive, *map(_token, items)]


# ---------------------------------------------------------------- unknown flags, overrides


def _option_names(options: Iterable[dict[str, Any]], prefix: str) -> dict[str, str]:
    """Prefixed option string -> dest, for every option of a snapshot (skipped ones included)."""
    return {f"--{prefix}-{s.lstrip('-')}": o["dest"] for o in options for s in o["option_strings"]}


def _close(name: str, candidates: Iterable[str], then: str = "") -> str:
    """'; did you mean X? Then' or '; then' (lower-cased) when nothing is close."""
    # Compare without the shared prefix, or every --sglang-* flag looks similar to every other.
    prefix = "--" + name[2:].split("-", 1)[0] + "-" if name.startswith("--") else ""
    bare = {c.removeprefix(prefix): c for c in candidates}
    match = difflib.get_close_matches(name.removeprefix(prefix), list(bare), n=1, cutoff=0.7)
    if match:
        return f"; did you mean {bare[match[0]]}?" + (f" {then}" if then else "")
    return f"; {then[:1].lower()}{then[1:]}" if then else ""


def check_unknown_prefixed(argv_unknown: list[str]) -> None:
    """Raise one clear SlimeArgError for the first `--sglang-*` / `--router-*` flag argparse did not accept."""
    sg_opts = _option_names(_all_sglang_options(), "sglang")
    rt_opts = _option_names(load_router_snapshot()["options"], "router")
    sg_known = [n for n, d in sg_opts.items() if d not in SKIPPED_SGLANG_FLAGS]
    sg_known += ["--" + d.replace("_", "-") for d in SLIME_SGLANG_FLAGS]
    rt_known = [n for n, d in rt_opts.items() if d not in SKIPPED_ROUTER_FLAGS]
    for token in argv_unknown:
        name = token.split("=", 1)[0]
        if name.startswith("--sglang-"):
            dest = sg_opts.get(name)
            if dest in SKIPPED_SGLANG_FLAGS:
                source = _SLIME_SOURCE.get(dest, "the engine's placement")
                raise SlimeArgError(f"{name} is not accepted: slime sets SGLang's {dest} itself from {source}")
            raise SlimeArgError(
                f"unknown SGLang flag {name} (not a flag of SGLang {' or '.join(SGLANG_SNAPSHOT_VERSIONS)}'s ServerArgs)"
                + _close(name, sg_known, "Run 'slime train --help-sglang' to list them")
            )
        if name.startswith("--router-"):
            dest = rt_opts.get(name)
            if dest in SKIPPED_ROUTER_FLAGS:
                source = _ROUTER_SOURCE.get(dest, "where it launches the router")
                raise SlimeArgError(f"{name} is not accepted: slime sets the router's {dest} itself from {source}")
            raise SlimeArgError(
                f"unknown router flag {name} (not a flag of sglang-router {ROUTER_VERSION})"
                + _close(name, rt_known, "Run 'slime train --help' to list them")
            )


def sglang_overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """ServerArgs dest -> value for every `--sglang-*` server flag the user set (slime's own flags excluded)."""
    out: dict[str, Any] = {}
    for dest in sglang_options_by_dest():
        if dest in SKIPPED_SGLANG_FLAGS:
            continue
        value = vars(args)[f"sglang_{dest}"]
        if value is not None:
            out[dest] = value
    return out


def router_overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Router dest -> value for every `--router-*` flag the user set."""
    out: dict[str, Any] = {}
    for dest in router_options_by_dest():
        if dest in SKIPPED_ROUTER_FLAGS:
            continue
        value = vars(args)[f"router_{dest}"]
        if value is not None:
            out[dest] = value
    return out


def validate_override_keys(keys: Iterable[str], where: str) -> None:
    """Check YAML `overrides` keys (dash or underscore spelling) against SGLang's ServerArgs CLI dests."""
    known = sglang_options_by_dest()
    for key in keys:
        dest = str(key).replace("-", "_")
        if dest in SKIPPED_SGLANG_FLAGS and dest not in OVERRIDABLE_SKIPPED:
            raise SlimeArgError(f"{where}: override {key!r} is not allowed: slime sets SGLang's {dest} per engine")
        if dest not in known:
            raise SlimeArgError(
                f"{where}: unknown SGLang server arg {key!r} (not in the ServerArgs of SGLang "
                f"{' or '.join(SGLANG_SNAPSHOT_VERSIONS)})"
                f"{_close(dest, known)}"
            )


def check_release_flags(user: dict[str, Any], version: str, where: str = "") -> None:
    """Refuse, in one line, a server flag the user set (`--sglang-*` or a --sglang-config override, as ServerArgs
    dests) that the release `version` does not have: the other snapshot's parser accepted it at parse time."""
    snap = snapshot_version_for(version)
    known = sglang_options_by_dest(snap)
    for dest in user:
        if dest in known:
            continue
        elsewhere = [v for v in SGLANG_SNAPSHOT_VERSIONS if dest in sglang_options_by_dest(v)]
        flag = f"--sglang-{dest.replace('_', '-')}" if not where else f"{where}: override {dest!r}"
        raise SlimeArgError(
            f"{flag} is not a server flag of SGLang {version} (the release the servers run; flags as of {snap}); "
            f"it is one of SGLang {', '.join(elsewhere)}" + _close(dest, known)
        )


def sglang_flags_help() -> str:
    """The text behind `slime train --help-sglang`: every accepted --sglang-* flag with its SGLang help."""
    p = argparse.ArgumentParser(prog="slime train", add_help=False, usage=argparse.SUPPRESS)
    add_sglang_arguments(p)
    return p.format_help()
