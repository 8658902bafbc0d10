"""Which protocol slime speaks to which SGLang release (slime/backends/sglang/versions.py)."""

from __future__ import annotations

import logging

import pytest

from slime.backends.sglang.versions import protocol_for, release

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize(
    ("version", "sessions"),
    [("0.5.14", False), ("0.5.17", False), ("0.5.17.post1", False), ("0.5.20", False), ("0.5.21rc0", True),
     ("0.5.21", True), ("0.5.23", True)],
)  # fmt: skip
def test_update_sessions_and_the_checker_skip_list_start_at_0_5_21(version, sessions):
    p = protocol_for(version)
    assert (p.weight_update_sessions, p.checker_skip_list, p.checked) == (sessions, sessions, True)
    assert p.version == version and ("in sessions" in p.describe()) is sessions


def test_older_releases_are_refused_and_newer_ones_spoken_to_as_the_newest_with_a_warning(caplog):
    with pytest.raises(ValueError, match="older than 0.5.14"):
        protocol_for("0.5.13")
    with pytest.raises(ValueError, match="not an SGLang version"):
        protocol_for("main")
    with caplog.at_level(logging.WARNING):
        p = protocol_for("0.6.0")
    assert p.weight_update_sessions and not p.checked and "newer than 0.5.23" in caplog.text
    assert release("0.5.17.post2") == (0, 5, 17)
