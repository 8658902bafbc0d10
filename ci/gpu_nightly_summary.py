"""The GPU nightly's summary: `nightly.json` and `nightly.md` in its output directory (ci/gpu-nightly.sh).

    python ci/gpu_nightly_summary.py OUT_DIR tests=0 sync=0 offload=1 train=0

Reads what the parts left there (pytest's JUnit XML, the benches' JSON) and each part's exit code. A part that
left nothing is reported as such, never as passed.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the bench modules format their own tables

BENCHES = {"sync": "gpu_weight_sync.json", "offload": "gpu_offload.json", "train": "gpu_train.json"}


def junit_counts(path: Path) -> dict[str, Any]:
    """Totals of a pytest JUnit XML file, and the ids of the tests that failed or errored."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed_ids"] = failed
    return counts


def train_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | Adam | micro-batches | step s | optimizer s | tokens/s | MFU | MFU w/o optimizer |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['adam']} | {r['micro_batches']} | {r['step_s_median']:.3f} | "
            f"{r['optimizer_s']:.3f} | {r['tokens_per_s']:.0f} | {r['mfu']:.1%} | {r['mfu_fwd_bwd_only']:.1%} |"
        )
    return "\n".join(lines)


def summarize(out: Path, codes: dict[str, int]) -> dict[str, Any]:
    from bench import gpu_offload, gpu_weight_sync

    summary: dict[str, Any] = {"parts": {}}
    md = [f"# GPU nightly ({out.name})", ""]
    for part, code in codes.items():
        entry: dict[str, Any] = {"exit_code": code}
        md.append(f"## {part}: {'ok' if code == 0 else f'FAILED (exit {code})'}")
        if part == "tests":
            xml = out / "tests.xml"
            if xml.is_file():
                entry.update(junit_counts(xml))
                md.append(
                    f"{entry['passed']} passed, {entry['failures']} failed, {entry['errors']} errors, "
                    f"{entry['skipped']} skipped"
                )
                md += [f"- failed: `{t}`" for t in entry["failed_ids"]]
            else:
                entry["missing"] = "tests.xml"
                md.append("no JUnit XML: pytest did not run to its end (see tests.log)")
        elif part in BENCHES:
            path = out / BENCHES[part]
            if path.is_file():
                res = json.loads(path.read_text())
                entry["result"] = res
                if part == "train":
                    md.append(train_table(res))
                else:
                    md.append((gpu_weight_sync if part == "sync" else gpu_offload).report(res))
            else:
                entry["missing"] = BENCHES[part]
                md.append(f"no {BENCHES[part]}: the bench did not get to its end (see {part}.log)")
        summary["parts"][part] = entry
        md.append("")
    summary["ok"] = all(c == 0 for c in codes.values())
    (out / "nightly.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "nightly.md").write_text("\n".join(md))
    return summary


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    codes = {k: int(v) for k, v in (a.split("=", 1) for a in argv[1:])}
    summary = summarize(out, codes)
    print((out / "nightly.md").read_text())
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
