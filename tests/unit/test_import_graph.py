"""The import graph of `slime/`: no cycle, no import running back up a floor, and `sim/` stays out.

Every import counts, including those inside functions: a lazy import hides a cycle from Python but not from a
reader. Edges are module to module (a package's `__init__` counts as the package).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(package: str = "slime") -> dict[str, set[str]]:
    files = {module_name(p): p for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base]) if base else ".".join(anchor)
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                # the longest known module the name refers to (`from a.b import c` may import module a.b.c)
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_slime() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_check_can_fail() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


# The floors of the house, lowest first; a module imports only from its own floor or below. A new room gets a
# floor here (the test refuses a module on none), so where it sits is decided once, in review.
FLOORS = (
    ("slime.utils", "slime.parallel_state"),  # ground: imported by every room
    ("slime.scheduling", "slime.algorithms"),  # pure: no Ray, HTTP or megatron
    ("slime.rollout", "slime.backends"),  # what generates and what trains
    ("slime.ray", "slime.agent"),  # the processes that run them
    ("slime.arguments", "slime.train", "slime.plan_cli", "slime.inspect_cli"),  # composition root, commands
    ("slime.cli",),
)


def floor_of(module: str) -> int | None:
    for i, rooms in enumerate(FLOORS):
        if any(module == r or module.startswith(r + ".") for r in rooms):
            return i
    return None


def upward(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """module -> the modules it imports from a higher floor."""
    out = {m: sorted(t for t in ts if t != "slime" and floor_of(t) > floor_of(m)) for m, ts in graph.items()}
    return {m: ts for m, ts in out.items() if ts}


def test_every_module_has_a_floor() -> None:
    assert sorted(m for m in import_graph() if m != "slime" and floor_of(m) is None) == []


def test_no_import_runs_back_up_a_floor() -> None:
    assert upward(import_graph()) == {}


def test_the_floor_check_can_fail() -> None:
    graph = {"slime.scheduling.arguments": {"slime.rollout.arguments"}, "slime.rollout.arguments": set()}
    assert upward(graph) == {"slime.scheduling.arguments": ["slime.rollout.arguments"]}


def test_slime_never_imports_sim() -> None:
    graph = import_graph()
    assert {
        m: sorted(t for t in ts if t.startswith("sim"))
        for m, ts in graph.items()
        if any(t.startswith("sim") for t in ts)
    } == {}


SIM_WORD = re.compile(r"\bsim\b")


def sim_mentions(package: str = "slime") -> list[str]:
    """file:line of every `sim` word in a package's Python source (code, strings and comments alike)."""
    return [
        f"{path.relative_to(ROOT)}:{i}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if SIM_WORD.search(line)
    ]


def test_slime_never_names_the_simulator() -> None:
    """The simulator enters as a plugin (pyproject.toml entry points): slime's source reads as if it did not
    exist — no import, no launch command, no flag or YAML key of its in slime/."""
    assert sim_mentions() == []
    assert sim_mentions("sim")  # the check finds the word where it is (it cannot pass by matching nothing)
