"""Scripted policies for CPU runs: a `scripted` fake-engine script under which every episode's reward is known.

For each task the policy makes one tool call through the harness's own tools, then answers "Done.":
Claude Code runs `git apply` on a heredoc with its `Bash` tool, Codex sends the same change as an
`apply_patch` call. Which patch it sends is fixed per task (`OUTCOMES`): the known-good patch
(`solutions/<task>.patch`) for half of the tasks, and for the others a wrong fix, a patch that edits the
failing tests to pass, or one that deletes the test file (`scripted/<task>.patch`). Only the known-good
patches score 1: the scorer applies no change to the tests (slime/agent/harness/scoring.py).

`REDTEAM` lists patches that leave the bug in place and pass the tests some other way, one or more per door the
scorer closes (`scripted/redteam/<name>.patch`, each says its trick in its first line): every one must score 0.

    python -m examples.coding_agent.scripted_policy --harness claude-code --out script.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TASKS = HERE / "tasks.jsonl"
OUTCOMES = {
    "stack-peek": "good",
    "roman-four": "good",
    "slug-dashes": "good",
    "wordcount-case": "good",
    "fizzbuzz-15": "good",
    "clamp-high": "good",
    "median-even": "wrong",
    "chunks-tail": "wrong",
    "temp-convert": "wrong",
    "palindrome-case": "edit-tests",
    "flatten-deep": "edit-tests",
    "dedupe-order": "delete-tests",
}

# (door, patch name, task): the test tree, the runner, the verdict channel, the framework in-process
REDTEAM = [
    ("test-tree", "tests-init-monkeypatch", "stack-peek"),
    ("test-tree", "tests-package-shadow", "roman-four"),
    ("runner", "runner-unittest-shadow", "slug-dashes"),
    ("runner", "runner-stdlib-shadow", "wordcount-case"),
    ("verdict", "verdict-forged-text", "fizzbuzz-15"),
    ("verdict", "verdict-every-descriptor", "clamp-high"),
    ("in-process", "inprocess-assert-patch", "roman-four"),
]


def redteam_patch(name: str) -> str:
    return (HERE / "scripted" / "redteam" / f"{name}.patch").read_text()


def expected_reward(instance_id: str) -> float:
    return 1.0 if OUTCOMES[instance_id] == "good" else 0.0


def policy_patch(instance_id: str) -> str:
    kind = "solutions" if OUTCOMES[instance_id] == "good" else "scripted"
    return (HERE / kind / f"{instance_id}.patch").read_text()


def to_codex_patch(diff: str) -> str:
    """A unified git diff as Codex's `apply_patch` envelope (update / add / delete file sections)."""
    out = ["*** Begin Patch"]
    for section in re.split(r"^diff --git ", diff, flags=re.M)[1:]:
        lines = section.splitlines()
        path = lines[0].split(" b/", 1)[1]
        body = [ln for ln in lines if ln[:1] in (" ", "-", "+") and not ln.startswith(("--- ", "+++ "))]
        if any(ln.startswith("deleted file") for ln in lines):
            out.append(f"*** Delete File: {path}")
        elif any(ln.startswith("new file") for ln in lines):
            out.append(f"*** Add File: {path}")
            out += [ln for ln in body if ln.startswith("+")]
        else:
            out.append(f"*** Update File: {path}")
            for ln in lines:
                if ln.startswith("@@"):
                    out.append("@@")
                elif ln[:1] in (" ", "-", "+") and not ln.startswith(("--- ", "+++ ")):
                    out.append(ln)
    return "\n".join(out + ["*** End Patch"]) + "\n"


def _call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def tool_call(harness: str, instance_id: str) -> str:
    patch = policy_patch(instance_id)
    if harness == "codex":
        return _call("apply_patch", {"input": to_codex_patch(patch)})
    return _call("Bash", {"command": f"git apply <<'SLIME_PATCH'\n{patch}SLIME_PATCH", "description": "apply fix"})


def build_script(harness: str, extra_rules: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    rules = list(extra_rules or [])
    for line in TASKS.read_text().splitlines():
        iid = json.loads(line)["metadata"]["instance_id"]
        head = re.escape(f"Issue {iid}:")
        rules.append({"match": head + r"[\s\S]*<tool_response>", "completion": "Done."})
        rules.append({"match": head, "completion": tool_call(harness, iid)})
    return {"rules": rules, "default": {"completion": "OK."}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--harness", choices=("claude-code", "codex"), default="claude-code")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    Path(a.out).write_text(json.dumps(build_script(a.harness), indent=1))
    print(f"wrote {a.out}: {sum(v == 'good' for v in OUTCOMES.values())}/{len(OUTCOMES)} tasks get the good patch")


if __name__ == "__main__":
    main()
