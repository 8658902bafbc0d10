"""One place per protocol: SGLang's control calls, child-process supervision, weight bucketing and atomic writes
each have exactly one implementation in `slime/` and `sim/`, so a fix reaches every caller.

The check is textual on purpose (a second implementation is usually a copy, not an import): each marker may
appear only in its owning module.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
CONTROL_ENDPOINTS = (
    "/pause_generation", "/continue_generation", "/flush_cache", "/abort_request", "/release_memory_occupation",
    "/resume_memory_occupation", "/begin_weight_update", "/end_weight_update", "/update_weights_from_tensor",
    "/update_weights_from_disk", "/update_weights_from_distributed", "/init_weights_update_group",
    "/destroy_weights_update_group", "/weights_checker", "/health_generate",
)  # fmt: skip

# marker -> the one module (relative path) of slime/ and sim/ production code allowed to contain it
OWNERS = {
    r"os\.killpg|prctl\(|preexec_fn=(?!die_with_parent)|start_new_session": "slime/utils/process.py",
    r"os\.replace\(|os\.rename\(": "slime/utils/atomic.py",
    # grouping tensors by size, and laying them out flat (the bucket format both transports and the fake share)
    r">\s*bucket_bytes|\.detach\(\)\.reshape\(-1\)": "slime/backends/megatron/weight_buckets.py",
}
# modules that may repeat a marker, and why they cannot import its owner
EXCEPTIONS = {
    # the first process of every sandboxed command runs as `python -I -S <file>` (also inside containers,
    # where slime is not installed): it sets PR_SET_PDEATHSIG on the command after dropping to the sandbox uid
    "slime/agent/sandbox_init.py": r"prctl\(",
}


def production_files() -> list[Path]:
    files = [*(ROOT / "slime").rglob("*.py"), *(ROOT / "sim").rglob("*.py")]
    return [p for p in files if "__pycache__" not in p.parts]


def code_lines(path: Path) -> list[str]:
    """Lines without comments and docstrings' prose markers (a mention in prose is not an implementation)."""
    out = []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            continue
        out.append(line.split("  # ")[0])
    return out


def offenders(pattern: str, owner: str, *, only: str = "slime") -> list[str]:
    found = []
    for path in production_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel == owner or not rel.startswith(only):
            continue
        lines = [ln for ln in code_lines(path) if not (rel in EXCEPTIONS and re.search(EXCEPTIONS[rel], ln))]
        if any(re.search(pattern, line) for line in lines):
            found.append(rel)
    return sorted(found)


@pytest.mark.parametrize("endpoint", CONTROL_ENDPOINTS)
def test_sglang_control_calls_are_made_by_one_client(endpoint: str) -> None:
    """slime/ posts SGLang's control endpoints only through slime/backends/sglang/client.py (the fake in sim/
    serves them: that is the other side of the protocol, not a second client)."""
    pattern = rf'["\']{re.escape(endpoint)}["\']'
    assert offenders(pattern, "slime/backends/sglang/client.py") == []


@pytest.mark.parametrize(("pattern", "owner"), sorted(OWNERS.items()))
def test_one_implementation(pattern: str, owner: str) -> None:
    assert offenders(pattern, owner, only="") == []


def test_the_check_finds_a_second_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "slime").mkdir()
    (tmp_path / "slime" / "copy.py").write_text('def post():\n    httpx.post(url + "/flush_cache")\n')
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert offenders(r'["\']/flush_cache["\']', "slime/backends/sglang/client.py") == ["slime/copy.py"]
