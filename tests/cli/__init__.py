"""Tests of the ``outboxkit`` command."""
