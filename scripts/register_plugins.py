"""Make the source tree's entry points (pyproject.toml) visible to a host that runs slime from PYTHONPATH.

slime finds the simulator's plugins (and anyone's) through entry points, which live in an installed
distribution's metadata. A GPU host without network runs the repository from PYTHONPATH instead of installing it
(docs/offline_gpu.md); there this writes that metadata, `slime_source_tree.dist-info/`, into a directory on
PYTHONPATH (e.g. .offline-site):

    python3 scripts/register_plugins.py .offline-site
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(target: str) -> Path:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = Path(target) / "slime_source_tree.dist-info"
    out.mkdir(parents=True, exist_ok=True)
    (out / "METADATA").write_text(f"Metadata-Version: 2.1\nName: slime-source-tree\nVersion: {project['version']}\n")
    lines = []
    for group, points in project.get("entry-points", {}).items():
        lines += [f"[{group}]", *(f"{name} = {value}" for name, value in points.items()), ""]
    (out / "entry_points.txt").write_text("\n".join(lines))
    return out


if __name__ == "__main__":
    print(
        f"entry points of {ROOT / 'pyproject.toml'} -> {main(sys.argv[1] if len(sys.argv) > 1 else '.offline-site')}"
    )
