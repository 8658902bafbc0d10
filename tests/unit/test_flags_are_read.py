"""Every flag of `slime train` does what its help says, or is refused: none is parsed and silently ignored.

The check is static: a parser destination counts as read when some module of `slime/` outside the argument
modules reads it (`x.dest`, or `getattr(x, "dest")`). Argument modules do not count, because a flag that is
only validated still does nothing. Three kinds of flags are accounted for differently, each with its own test:
the SGLang / router pass-through flags (forwarded generically to the server argv), the flags refused until
their feature exists (`unsupported_flags()`), and the few flags the parser itself implements.
"""

from __future__ import annotations

import argparse
import ast
import inspect
from pathlib import Path

import pytest

import slime
from slime.arguments import build_parser, parse_args, unsupported_flags
from slime.backends.sglang import server_plugins
from slime.backends.sglang.flags import (
    SKIPPED_ROUTER_FLAGS,
    SKIPPED_SGLANG_FLAGS,
    SLIME_SGLANG_FLAGS,
    router_options_by_dest,
    router_overrides_from_args,
    sglang_options_by_dest,
    sglang_overrides_from_args,
)
from slime.utils.errors import SlimeArgError

pytestmark = pytest.mark.cpu

SLIME = Path(slime.__file__).parent
PARSER_MODULES = {"arguments.py", "flags.py"}
# Flags the parser itself implements (their effect is a rewrite of other flags), each tested in test_arguments.py.
IMPLEMENTED_BY_PARSER = {
    "custom_config_path": "parse_args sets the YAML's keys onto args",
    "dump_details": "validate_args derives --save-debug-rollout-data from it",
    "offload": "validate_cluster_args turns on --offload-train and --offload-rollout",
    "num_steps_per_rollout": "validate_batching_args derives --global-batch-size from it",
    "num_layers_per_virtual_pipeline_stage": "validate_megatron_args derives --virtual-pipeline-model-parallel-size "
    "from it (tests/unit/test_vpp_flag.py)",
    "agent_harness": "resolve_agent_args sets --custom-generate-function-path to the harness's generate",
}


def _passthrough_dests() -> set[str]:
    sglang = {f"sglang_{d}" for d in sglang_options_by_dest() if d not in SKIPPED_SGLANG_FLAGS}
    router = {f"router_{d}" for d in router_options_by_dest() if d not in SKIPPED_ROUTER_FLAGS}
    return (sglang | router) - set(SLIME_SGLANG_FLAGS)


def names_read(root: Path, skip_files: set[str]) -> set[str]:
    """Attribute names loaded, and string constants given to getattr/hasattr, in every module under `root`."""
    return names_read_in([p for p in root.rglob("*.py") if p.name not in skip_files])


def names_read_in(paths: list[Path]) -> set[str]:
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
            ):
                names.add(node.args[1].value)
    return names


def plugin_reads() -> set[str]:
    """Names read by the registered server plugins' modules: a plugin's own flags are read there, not in slime/."""
    return names_read_in(sorted({Path(inspect.getsourcefile(type(p))) for p in server_plugins.registered().values()}))


def unread_flags(parser: argparse.ArgumentParser, root: Path = SLIME) -> list[str]:
    read = names_read(root, PARSER_MODULES) | plugin_reads()
    exempt = _passthrough_dests() | set(unsupported_flags()) | set(IMPLEMENTED_BY_PARSER) | {"help"}
    return sorted(a.dest for a in parser._actions if a.dest not in read and a.dest not in exempt)


def test_every_flag_is_read_outside_the_parser() -> None:
    assert unread_flags(build_parser()) == []


def test_an_unread_flag_is_caught() -> None:
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument("--nobody-reads-this-flag", type=int, default=3)

    assert unread_flags(build_parser(add)) == ["nobody_reads_this_flag"]


def test_every_pass_through_flag_reaches_the_forwarder(make_args) -> None:
    """The generic forwarders read every pass-through dest: set each to a sentinel and find it forwarded."""
    dests = _passthrough_dests()
    args = make_args()
    for d in dests:
        setattr(args, d, "sentinel")
    forwarded = {f"sglang_{k}" for k in sglang_overrides_from_args(args)}
    forwarded |= {f"router_{k}" for k in router_overrides_from_args(args)}
    assert forwarded == dests


@pytest.mark.parametrize("dest", sorted(unsupported_flags()))
def test_unsupported_flags_are_refused_before_ray(dest: str, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    action = next(a for a in build_parser()._actions if a.dest == dest)
    flag = action.option_strings[0]
    value = [] if action.nargs == 0 else [{"int": "2", "float": "0.5"}.get(getattr(action.type, "__name__", ""), "x")]
    base = ["--hf-checkpoint", str(tmp_path), "--rollout-batch-size", "1", "--num-rollout", "1", "--colocate"]
    with pytest.raises(SlimeArgError, match=f"{flag} is not supported yet"):
        parse_args([*base, flag, *value])


def test_parser_implemented_flags_exist() -> None:
    dests = {a.dest for a in build_parser()._actions}
    assert set(IMPLEMENTED_BY_PARSER) <= dests
