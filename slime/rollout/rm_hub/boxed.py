"""Extract the last `\\boxed{...}` answer from a response.

Why a brace matcher and not a regex: answers nest braces (`\\boxed{\\frac{1}{2}}`), which a regex cannot
balance; the *last* box wins because models often restate intermediate results in boxes before the final one.
"""

from __future__ import annotations

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def match_brace(text: str, open_pos: int) -> int | None:
    """Index of the `}` closing the `{` at `open_pos`, or None when unbalanced."""
    depth = 0
    i = open_pos
    while i < len(text):
        c = text[i]
        if c == "\\":  # `\{` and `\}` are literal braces, not grouping
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def last_boxed_answer(text: str) -> str | None:
    """Content of the last well-formed `\\boxed{...}` (or `\\fbox{...}`, `\\boxed 5`), or None."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    while start >= 0:
        cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
        pos = start + len(cmd)
        if pos < len(text) and text[pos] == "{":
            end = match_brace(text, pos)
            if end is not None:
                return text[pos + 1 : end]
        elif pos < len(text) and text[pos] == " ":
            # `\boxed 5`: the argument is the next whitespace-free run
            rest = text[pos:].lstrip(" ")
            token = rest.split()[0].rstrip("$.") if rest.split() else ""
            if token:
                return token
        # malformed (unbalanced) box: fall back to an earlier one
        start = max(text.rfind(cmd, 0, start) for cmd in _BOX_COMMANDS)
    return None
