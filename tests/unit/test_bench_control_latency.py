"""bench/control_latency.py: one row per gap, each from real round trips to a fake engine, written as JSON."""

import json

import pytest

from bench.control_latency import main, report

pytestmark = pytest.mark.cpu


def test_rows_per_gap_from_real_round_trips(tmp_path, capsys):
    out = tmp_path / "latency.json"
    result = main(["--gaps-ms", "0", "3", "--repeats", "12", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert [r["gap_s"] for r in result["rows"]] == [0.0, 0.003]
    for r in result["rows"]:
        assert 0 < r["median_s"] <= r["p90_s"]
    table = capsys.readouterr().out
    assert "| 3 ms |" in table and "| 0 ms |" in table


def test_report_gives_each_row_its_ratio_to_the_first():
    rows = [
        {"gap_s": 0.0, "median_s": 0.0002, "p90_s": 0.0003},
        {"gap_s": 0.01, "median_s": 0.001, "p90_s": 0.0012},
    ]
    lines = report(rows).splitlines()
    assert lines[2] == "| 0 ms | 0.200 ms | 0.300 ms | 1.00 |"
    assert lines[3] == "| 10 ms | 1.000 ms | 1.200 ms | 5.00 |"
