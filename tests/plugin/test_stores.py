"""``outboxkit.testing.stores``: a fresh store per test, a PostgreSQL schema of its own."""

from __future__ import annotations

import psycopg
import pytest

from tests.integration.pg.conftest import pg_url_from_env, require_server
from tests.integration.pg.conftest import test_url as pg_test_url


@pytest.mark.pg
def test_postgres_schema_per_test_under_xdist(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    url = pg_test_url(pg_url_from_env())
    require_server(pg_url_from_env())
    pytester.makepyfile(
        test_many="""
        import pytest

        @pytest.mark.parametrize("n", range(6))
        def test_isolated(outbox, outbox_store, outbox_drain, n):
            assert outbox_store.stats(now=None).total == 0   # nothing from other tests
            assert outbox_store.names.schema.startswith("outboxkit_test_gw")
            with outbox_store.transaction() as conn:
                outbox.enqueue(conn, "t", {"n": n})
            assert len(outbox_drain().published) == 1
        """
    )
    result = pytester.runpytest_subprocess(
        "-q", "-p", "no:cacheprovider", "-n", "2", f"--outbox-store={url}"
    )
    result.assert_outcomes(passed=6)
    with psycopg.connect(pg_url_from_env(), autocommit=True) as conn:
        left = conn.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'outboxkit_test_gw%'"
        ).fetchone()
    assert left == (0,)
