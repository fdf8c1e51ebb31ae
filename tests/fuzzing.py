"""Hypothesis profiles for the fuzz tests (tests/test_fuzz_*.py).

``make test`` runs the short default profile (150 examples per test, the whole
set in about 15 s); ``HYPOTHESIS_PROFILE=long`` (``make fuzz``) runs
thousands. No deadline: the machines are shared and timings vary.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=150, deadline=None, derandomize=False,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.function_scoped_fixture])
settings.register_profile("long", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
