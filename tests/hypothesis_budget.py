"""How many examples a property test runs: the stated count under CI, a fifth of it on a laptop.

Why: CI (`CI=true`, `.ci/run`) is where a property has to hold for its full count: 200-300 examples, enough to
find the counterexamples these tests were written against. The README's quick command on a 2-core laptop runs
the same properties with a fifth of the examples (at least 20), so a change is checked in minutes and CI then
checks it in full; without this, the hypothesis tests alone took ~120 s of the quick suite's ~440 test-seconds.
`HYPOTHESIS_PROFILE=ci` runs the full counts anywhere, `HYPOTHESIS_PROFILE=dev` the reduced ones.

Tests write `@settings(max_examples=examples(200))`; a test that states no count gets the profile's (200 / 40).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") == "true" else "dev")
FULL = PROFILE == "ci"

settings.register_profile(
    "ci", max_examples=200, deadline=None, derandomize=False, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """`n` under the ci profile; n // 5 (at least 20, at most n) under dev."""
    return n if FULL else min(n, max(20, n // 5))
