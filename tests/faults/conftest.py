"""The fault suite. Tests marked ``faults`` need ``--faults`` (see tests/conftest.py);
the fast tables here (bad input, misbehaving handlers) run in the default tier.

The PostgreSQL fixtures (``pg_url``, ``pg_schema``, ``pg_store``, ``admin``) are the Postgres
integration tests' own, reused as they are.
"""

from __future__ import annotations

from tests.faults._sites import site
from tests.integration.pg.conftest import admin, pg_schema, pg_store, pg_url

__all__ = ["admin", "pg_schema", "pg_store", "pg_url", "site"]
