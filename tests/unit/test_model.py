"""Value objects of ``outboxkit.core.model`` that say something to an operator."""

from __future__ import annotations

import pytest

from outboxkit import Migration


@pytest.mark.parametrize(
    ("before", "after", "said", "changed"),
    [
        (0, 4, "created schema v4", True),
        (2, 4, "upgraded 2 -> 4", True),
        (4, 4, "already at v4", False),
    ],
)
def test_a_migration_says_what_it_did(before: int, after: int, said: str, changed: bool) -> None:
    done = Migration(before=before, after=after)
    assert str(done) == said
    assert done.changed is changed
