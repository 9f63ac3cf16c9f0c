"""Hypothesis settings profiles of the property-based and fuzz tests (docs/bug-classes.md).

* ``ci`` (the default): a few examples per test, derandomized (every run draws the
  same examples, so CI never turns red on an unrelated change), no deadline (the
  CPU graph simulator and shared runners are slow), no example database;
* ``long``: about 40 times as many examples, random, with the example database, for
  a local or nightly search.

Importing this module registers both and, unless a profile was already chosen,
loads the one named by ``$LORA_KIT_HYPOTHESIS_PROFILE`` (default ``ci``). To pick one
on the pytest command line, load this module as a plugin first, so the profile
exists when Hypothesis's own plugin reads ``--hypothesis-profile``::

    pytest -p lora_core.testing.hypothesis_profiles --hypothesis-profile long \\
        tests/test_properties.py packages/lora-core/tests/test_fuzz_construction.py

Tests size their budget with :func:`budget`, so one test can be cheaper than another
under every profile. Hypothesis is a test dependency (``lora-core[test]``): nothing
else in ``lora_core.testing`` imports this module.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

__all__ = ["LONG_FACTOR", "PROFILE_ENV", "budget", "register_profiles"]

PROFILE_ENV = "LORA_KIT_HYPOTHESIS_PROFILE"
LONG_FACTOR = 40
"""``long`` runs this many times the ``ci`` examples of each test (unless a test says otherwise)."""

_SUPPRESSED = (
    HealthCheck.too_slow,
    HealthCheck.data_too_large,
    HealthCheck.function_scoped_fixture,  # the `device` fixture is immutable: sharing it is safe
)


def register_profiles() -> None:
    """Register ``ci`` and ``long`` (idempotent)."""
    settings.register_profile("ci", max_examples=10, deadline=None, derandomize=True, database=None,
                              suppress_health_check=_SUPPRESSED, print_blob=True)
    settings.register_profile("long", max_examples=10 * LONG_FACTOR, deadline=None, derandomize=False,
                              suppress_health_check=_SUPPRESSED, print_blob=True)


def budget(ci: int, long: int | None = None) -> settings:
    """Settings for one test: ``ci`` examples under the ``ci`` profile, ``long`` (default
    ``ci * LONG_FACTOR``) under ``long``; any other profile keeps its own ``max_examples``.

    Use it as a decorator below ``@given``; it reads the profile loaded when the test
    module is imported (after pytest has applied ``--hypothesis-profile``)."""
    name = settings.get_current_profile_name()
    if name == "ci":
        return settings(max_examples=ci)
    if name == "long":
        return settings(max_examples=long if long is not None else ci * LONG_FACTOR)
    return settings()


register_profiles()
if settings.get_current_profile_name() == "default":
    settings.load_profile(os.environ.get(PROFILE_ENV, "ci"))
