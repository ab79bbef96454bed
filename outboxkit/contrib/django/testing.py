"""The test kit under pytest-django: an ``outbox_store`` fixture on Django's connection.

Import it into your ``conftest.py`` (``from outboxkit.contrib.django.testing import
outbox_store``); ``outbox``, ``outbox_drain`` and the rest of outboxkit's fixtures then run on
the test database:

- with ``db`` (the test inside a transaction that is rolled back): the drain runs on the same
  connection, inside that transaction, so it sees the test's uncommitted rows and events, and
  every delivery is a savepoint of it;
- with ``transactional_db``: the drain commits as a poller does; the outbox tables (not Django
  models, so Django's flush leaves them) are emptied after the test.

A test using neither gets pytest-django's refusal of database access, at its first enqueue or
drain.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .store import DjangoStore

__all__ = ["outbox_store"]


@pytest.fixture
def outbox_store(request: pytest.FixtureRequest) -> Iterator[DjangoStore]:
    """The app's Django store on the test database (see the module docstring)."""
    marker = request.node.get_closest_marker("django_db")
    transactional = "transactional_db" in request.fixturenames or bool(
        marker is not None and marker.kwargs.get("transaction")
    )
    # Set up before this fixture, so torn down after it: the database is reachable below.
    if transactional:
        request.getfixturevalue("transactional_db")
    elif "db" in request.fixturenames or marker is not None:
        request.getfixturevalue("db")
    store = DjangoStore()
    yield store
    if transactional:
        store.clear()
    store.close()
