"""The fault suite's size tier: how many events, kills... a fault test runs with.

``OUTBOXKIT_FAULTS_SCALE`` picks the tier:

- ``pr`` (the default, also when the variable is unset or empty): the sizes a pull request's CI
  runs, a few seconds to a minute per test;
- ``large``: a longer run for a nightly job or before a release (more events, more faults).

A test reads its sizes once, at import, as module constants::

    from tests.faults._scale import scale

    EVENTS = scale(pr=900, large=4500)
    KILLS = scale(pr=6, large=12)

Any other value of the variable is an error (raised at import, so the run stops at collection)
rather than a silent fall-back to the small tier.
"""

from __future__ import annotations

import os

__all__ = ["ENV", "TIERS", "scale", "tier"]

ENV = "OUTBOXKIT_FAULTS_SCALE"
TIERS = ("pr", "large")


def tier() -> str:
    """The tier ``OUTBOXKIT_FAULTS_SCALE`` names: ``"pr"`` (default) or ``"large"``.

    Raises:
        ValueError: the variable holds anything else (the message names it and its value).
    """
    value = os.environ.get(ENV, "").strip().lower() or "pr"
    if value not in TIERS:
        raise ValueError(f"{ENV} must be one of {', '.join(TIERS)}, got {os.environ[ENV]!r}")
    return value


def scale(pr: int, large: int) -> int:
    """``pr`` in the PR tier, ``large`` in the large tier (see the module docstring).

    Raises:
        ValueError: ``OUTBOXKIT_FAULTS_SCALE`` is set to an unknown tier.
    """
    return large if tier() == "large" else pr
