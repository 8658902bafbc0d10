"""`bench/test_suite.py` reads pytest's summary line (the counts decide whether a timed run counts at all)."""

from __future__ import annotations

import pytest

from bench.test_suite import parse_summary

pytestmark = pytest.mark.cpu


def test_summary_counts_and_seconds() -> None:
    out = "....\n===== 703 passed, 2 skipped, 14 warnings in 241.58s (0:04:01) =====\n"
    assert parse_summary(out) == {"pytest_s": 241.58, "passed": 703, "skipped": 2, "warnings": 14}
    assert parse_summary("== 1 failed, 704 passed in 3.10s ==")["failed"] == 1
    assert parse_summary("...\n707 passed, 14 warnings in 270.23s (0:04:30)\n")["passed"] == 707  # pytest -q


def test_no_summary_is_an_error() -> None:
    with pytest.raises(ValueError, match="no pytest summary"):
        parse_summary("ImportError: no module named x\n")
