"""Tests of the ``outboxkit`` command (issue 7)."""
