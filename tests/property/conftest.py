"""Hypothesis profiles for the property suite.

"ci" (loaded when CI=true) runs 200 examples per property, as the issues require; "dev" runs fewer so
`pytest -m "cpu and not slow" -n 2` stays quick on a laptop. HYPOTHESIS_PROFILE overrides the choice.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=200, deadline=None, derandomize=False, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") == "true" else "dev"))
