"""YAML read through `yaml.compose` nodes, so every mistake is one line naming file, line and YAML path.

Why nodes and not `yaml.safe_load`: only the node tree keeps line numbers. The topology and role configs
(`--sglang-config`, `--megatron-config`) read their files with these helpers; each error comes back as
`FLAG FILE:LINE: yaml.path: why` (a `SlimeArgError`, raised before anything starts).
"""

from __future__ import annotations

import difflib
from typing import Any

import yaml

from slime.utils.errors import SlimeArgError


class YamlContext:
    """The flag and file being read: builds the one-line errors and turns scalar nodes into values."""

    def __init__(self, flag: str, path: str) -> None:
        self.flag = flag
        self.path = path
        self._scalar = yaml.SafeLoader("")

    def error(self, node: yaml.Node | None, where: str, message: str) -> SlimeArgError:
        line = f":{node.start_mark.line + 1}" if node is not None else ""
        loc = f"{where}: " if where else ""
        return SlimeArgError(f"{self.flag} {self.path}{line}: {loc}{message}")

    def value(self, node: yaml.Node) -> Any:
        return self._scalar.construct_object(node, deep=True)


def kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return f"{node.value!r}" if node.value != "" else "nothing"


def as_mapping(ctx: YamlContext, node: yaml.Node, where: str, allowed: tuple[str, ...] | None) -> dict[str, yaml.Node]:
    """Key -> value node; duplicate keys and (with `allowed`) unknown keys are errors."""
    if not isinstance(node, yaml.MappingNode):
        raise ctx.error(node, where, f"expected a mapping, got {kind(node)}")
    out: dict[str, yaml.Node] = {}
    for knode, vnode in node.value:
        key = ctx.value(knode)
        if not isinstance(key, str):
            raise ctx.error(knode, where, f"keys must be strings, got {key!r}")
        sub = f"{where}.{key}" if where else key
        if key in out:
            raise ctx.error(knode, sub, "duplicate key")
        if allowed is not None and key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; allowed: {', '.join(allowed)}"
            raise ctx.error(knode, sub, f"unknown key{hint}")
        out[key] = vnode
    return out


def as_sequence(ctx: YamlContext, node: yaml.Node, where: str) -> list[yaml.Node]:
    if not isinstance(node, yaml.SequenceNode):
        raise ctx.error(node, where, f"expected a list, got {kind(node)}")
    if not node.value:
        raise ctx.error(node, where, "must not be empty")
    return list(node.value)


def as_str(ctx: YamlContext, node: yaml.Node, where: str) -> str:
    v = ctx.value(node) if isinstance(node, yaml.ScalarNode) else None
    if not isinstance(v, str) or not v:
        raise ctx.error(node, where, f"expected a non-empty string, got {kind(node)}")
    return v


def as_positive_int(ctx: YamlContext, node: yaml.Node, where: str) -> int:
    v = ctx.value(node) if isinstance(node, yaml.ScalarNode) else None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ctx.error(node, where, f"expected a positive integer, got {kind(node)}")
    return v


def as_bool(ctx: YamlContext, node: yaml.Node, where: str) -> bool:
    v = ctx.value(node) if isinstance(node, yaml.ScalarNode) else None
    if not isinstance(v, bool):
        raise ctx.error(node, where, f"expected true or false, got {kind(node)}")
    return v


def compose_file(flag: str, path: str) -> yaml.Node | None:
    """The file's root node (None for an empty file); unreadable files and syntax errors are one-line errors."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise SlimeArgError(f"{flag} {path}: cannot read: {e.strerror or e}") from None
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = " ".join(str(e.problem or e.context or "syntax error").split())
        raise SlimeArgError(f"{flag} {path}{line}: invalid YAML: {problem}") from None
    except yaml.YAMLError as e:
        raise SlimeArgError(f"{flag} {path}: invalid YAML: {' '.join(str(e).split())}") from None
