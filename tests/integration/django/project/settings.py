"""Settings of the tests' Django project, from the environment:

- ``OUTBOXKIT_DJANGO_BACKEND``: ``sqlite`` (default), ``sqlite-memory`` (the same, with Django's
  default test database: SQLite in memory) or ``postgresql``;
- ``OUTBOXKIT_DJANGO_NAME``: the SQLite file, or the PostgreSQL database's name (pytest-django
  creates ``test_<name>`` and drops it afterwards);
- ``OUTBOXKIT_TEST_PG``: the PostgreSQL server, as for the other PostgreSQL tests.
"""

import os
from urllib.parse import unquote, urlsplit

BACKEND = os.environ.get("OUTBOXKIT_DJANGO_BACKEND", "sqlite")
NAME = os.environ.get("OUTBOXKIT_DJANGO_NAME", "outboxkit-django.db")

SECRET_KEY = "tests-only"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["outboxkit.contrib.django", "shop"]

if BACKEND in ("sqlite", "sqlite-memory"):
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": NAME,
            "OPTIONS": {"timeout": 30},  # seconds to wait for SQLite's write lock
            # A real file, or (sqlite-memory) Django's default test database: in memory.
            "TEST": {"NAME": NAME} if BACKEND == "sqlite" else {},
        }
    }
elif BACKEND == "postgresql":
    server = urlsplit(
        os.environ.get("OUTBOXKIT_TEST_PG") or "postgresql://postgres@127.0.0.1:5432/postgres"
    )
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": NAME,
            "HOST": server.hostname or "",
            "PORT": server.port or "",
            "USER": unquote(server.username or ""),
            "PASSWORD": unquote(server.password or ""),
            # The tests check what pollers do, not what survives a crash of the server.
            "OPTIONS": {"options": "-c synchronous_commit=off"},
        }
    }
else:
    raise RuntimeError(
        f"OUTBOXKIT_DJANGO_BACKEND must be sqlite, sqlite-memory or postgresql, got {BACKEND!r}"
    )

OUTBOXKIT = {"DATABASE": "default", "OUTBOX": "shop.events:outbox"}
