"""A rule-based math answer grader: 1.0 when the response's answer equals the label, else 0.0.

Why rules and not sympy: rewards are computed for every sample of every rollout, so the grader must be fast,
dependency-free and never hang. It normalises LaTeX-ish notation away, then compares values numerically
(fractions, `\\frac`, decimals, percent, scientific notation, `\\sqrt`, `\\pi`) through a tiny whitelisted
arithmetic evaluator, element-wise for tuples, and finally as normalised strings.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from typing import Any

from slime.rollout.rm_hub.boxed import last_boxed_answer, match_brace

REL_TOL = 1e-4
ABS_TOL = 1e-9

_WRAPPER_RE = re.compile(r"\\(?:text|textbf|textrm|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_DEGREE_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°")
_UNIT_RE = re.compile(
    r"(?<=[\d}.])\s*(?:(?:square|sq\.?)\s*)?"
    r"(?:units?|cm|mm|km|meters?|metres?|inch(?:es)?|in\.|feet|foot|ft|yards?|miles?|degrees?|dollars?|cents?"
    r"|hours?|hrs?|minutes?|mins?|seconds?|secs?|days?|weeks?|years?|kg|grams?|g|mph|km/h|liters?|litres?|ml)"
    r"(?:\^\{?[23]\}?)?\s*$",
    re.IGNORECASE,
)
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_ASSIGN_RE = re.compile(r"^\s*[a-zA-Z]\w?\s*=(?!=)")
_SPACING = ("\\!", "\\,", "\\;", "\\:", "\\quad", "\\qquad", "\\displaystyle")


def _strip_wrappers(s: str) -> str:
    while True:
        new = _WRAPPER_RE.sub(r"\1", s)
        if new == s:
            return s
        s = new


def normalize_math_answer(text: Any) -> str:
    """Canonical string form of an answer (boxed content, no LaTeX spacing/markup/units, lower case)."""
    s = str(text).strip()
    boxed = last_boxed_answer(s)
    if boxed is not None:
        s = boxed
    s = _strip_wrappers(s.replace("\n", " "))
    for token in _SPACING:
        s = s.replace(token, "")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\ ", " ")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "%")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _DEGREE_RE.sub("", s)
    if s.count("=") == 1 and _ASSIGN_RE.match(s):  # `x = 5` -> `5`
        s = s.split("=", 1)[1]
    s = s.strip().rstrip(".").strip()
    s = _UNIT_RE.sub("", s)
    s = re.sub(r"\s+", "", s)
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    # `\frac12` -> `\frac{1}{2}`, `\sqrt2` -> `\sqrt{2}`: same value, same string
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\{[^{}]*\})(\d)", r"\\frac\1{\2}", s)
    s = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)
    s = s.rstrip(".")
    m = re.fullmatch(r"\(([a-zA-Z])\)", s)  # multiple choice `(A)` -> `a`
    if m:
        s = m.group(1)
    return s.lower()


# ---- numeric evaluation ------------------------------------------------------------------------------

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _eval_node(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval_node(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp):
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > 1000:
                raise ValueError("exponent too large")
            out = left**right
            if isinstance(out, complex):
                raise ValueError("complex result")
            return float(out)
        if type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](left, right)
    if isinstance(node, ast.Name) and node.id == "pi":
        return math.pi
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "sqrt"
        and len(node.args) == 1
        and not node.keywords
    ):
        return math.sqrt(_eval_node(node.args[0]))
    raise ValueError(f"unsupported expression node {type(node).__name__}")


def _replace_command(s: str, cmd: str, n_args: int, fmt: str) -> str | None:
    """Rewrite `\\cmd{a}{b}` as `fmt.format(a, b)` (innermost-last, recursive); None when braces do not balance."""
    while (i := s.find(cmd)) >= 0:
        pos = i + len(cmd)
        groups = []
        for _ in range(n_args):
            if pos >= len(s) or s[pos] != "{":
                return None
            end = match_brace(s, pos)
            if end is None:
                return None
            groups.append(s[pos + 1 : end])
            pos = end + 1
        s = s[:i] + fmt.format(*groups) + s[pos:]
    return s


def _latex_to_expr(s: str) -> str | None:
    s = re.sub(r"\\sqrt\[([^\]]+)\]\{", r"\\root{\1}{", s)
    for cmd, n, fmt in (("\\frac", 2, "(({})/({}))"), ("\\root", 2, "(({1})**(1/({0})))"), ("\\sqrt", 1, "sqrt({})")):
        out = _replace_command(s, cmd, n, fmt)
        if out is None:
            return None
        s = out
    for a, b in (
        ("\\times", "*"),
        ("\\cdot", "*"),
        ("\\div", "/"),
        ("\\pi", "pi"),
        ("^", "**"),
        ("{", "("),
        ("}", ")"),
    ):
        s = s.replace(a, b)
    if "\\" in s or not re.fullmatch(r"[0-9.+\-*/()a-z]+", s):
        return None
    if re.search(r"[a-z]", re.sub(r"sqrt|pi|(?<=\d)e(?=[+\-]?\d)", "", s)):
        return None
    s = re.sub(r"(\d*\.?\d+)e([+\-]?\d+)", r"(\1*10**(\2))", s)  # scientific notation
    s = re.sub(r"(?<![\d.])0+(?=\d)", "", s)  # Python rejects leading zeros in int literals
    s = re.sub(r"(?<=[\d)])(?=[(a-z])|(?<=pi)(?=[(\d])", "*", s)  # implicit multiplication: 2pi, 2(3)
    return s


def to_number(s: str) -> list[float]:
    """Candidate values of a normalised answer (two for a percent: as written and /100); [] if not numeric."""
    percent = s.endswith("%")
    expr = _latex_to_expr(s[:-1] if percent else s)
    if not expr:
        return []
    try:
        value = _eval_node(ast.parse(expr, mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError, TypeError):
        return []
    if not math.isfinite(value):
        return []
    return [value, value / 100] if percent else [value]


def _split_top_level(s: str) -> tuple[str, list[str]] | None:
    """`(a,b)` -> ('()', ['a', 'b']); None when `s` is not a bracketed/plain comma list."""
    brackets = ""
    if len(s) >= 2 and s[0] in "([{" and s[-1] in ")]}":
        brackets, s = s[0] + s[-1], s[1:-1]
    parts, depth, cur = [], 0, []
    for c in s:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return (brackets, parts) if len(parts) > 1 else None


def _equivalent(a: str, b: str) -> bool:
    if a == b:
        return True
    na, nb = to_number(a), to_number(b)
    if na and nb:
        if re.fullmatch(r"-?\d+", a) and re.fullmatch(r"-?\d+", b):
            return int(a) == int(b)  # integers compare exactly, not within a relative tolerance
        return any(math.isclose(x, y, rel_tol=REL_TOL, abs_tol=ABS_TOL) for x in na for y in nb)
    sa, sb = _split_top_level(a), _split_top_level(b)
    if sa and sb and sa[0] == sb[0] and len(sa[1]) == len(sb[1]):
        return all(_equivalent(x, y) for x, y in zip(sa[1], sb[1], strict=True))
    return False


def grade_math(response: str, label: Any) -> float:
    """1.0 if the response's (last boxed, else whole) answer matches the label (or any label in a list)."""
    pred = normalize_math_answer(response)
    if not pred:
        return 0.0
    labels = label if isinstance(label, (list, tuple)) else [label]
    return 1.0 if any(_equivalent(pred, normalize_math_answer(g)) for g in labels if g is not None) else 0.0
