"""Least privilege: the PostgreSQL page's grants ("Least privilege"), run as written.

An owner role runs the migrations in a schema it owns; a poller role with DML grants only runs a
full drain (its handler writes an app table it may insert into) and cannot create a table; an
app role can only enqueue. The roles are dropped afterwards.
"""

from __future__ import annotations

import re
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import errors, sql
from psycopg.conninfo import make_conninfo

from outboxkit import Event, EventBus, Message, Outbox, StoreError
from outboxkit_pg import PostgresStore
from tests.docs import blocks, page

from .conftest import fresh_schema

pytestmark = pytest.mark.pg


def as_role(url: str, role: str) -> str:
    return make_conninfo(url, user=role)


def page_sql(schema: str, owner: str, poller: str, app: str) -> tuple[sql.Composed, sql.Composed]:
    """The grants of the PostgreSQL page ("Least privilege"), as written, its names replaced by
    the test's: what an administrator runs, and what the owner runs after ``migrate()``."""
    (text,) = blocks(page("how-to/postgresql.md"), "sql")
    admin_part, owner_part = text.split("-- ... connect as outbox_owner, run outbox.migrate()")
    owner_part = owner_part.split("\n", 1)[1]

    def composed(part: str) -> sql.Composed:
        template = re.sub(r"\boutbox_owner\b", "{owner}", part)
        template = re.sub(r"\boutbox_poller\b", "{poller}", template)
        template = re.sub(r"\bTO app;", "TO {app};", template)
        template = re.sub(r"\bSCHEMA outbox\b", "SCHEMA {schema}", template)
        template = re.sub(r"\boutbox\.(outbox_\w+)", r"{schema}.\1", template)
        assert "app" not in re.sub(r"--.*", "", template).replace("{app}", ""), template
        return sql.SQL(template).format(  # type: ignore[arg-type]  # the page's own text
            owner=sql.Identifier(owner),
            poller=sql.Identifier(poller),
            app=sql.Identifier(app),
            schema=sql.Identifier(schema),
        )

    return composed(admin_part), composed(owner_part)


def drop_role(admin: psycopg.Connection[Any], role: str) -> None:
    admin.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,)
    )
    exists = admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
    if exists:
        admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_poller_role_drains_with_dml_grants_only(
    pg_url: str, admin: psycopg.Connection[Any]
) -> None:
    tag = uuid.uuid4().hex[:8]
    owner, poller, app = f"okt_owner_{tag}", f"okt_poller_{tag}", f"okt_app_{tag}"
    stores: list[PostgresStore] = []
    with fresh_schema(pg_url) as schema:
        try:
            as_admin, as_owner = page_sql(schema, owner, poller, app)
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(app)))  # the app's
            admin.execute(as_admin)
            # The owner migrates, and grants.
            owner_store = PostgresStore(as_role(pg_url, owner), schema=schema)
            stores.append(owner_store)
            owner_store.migrate()
            ledger = sql.Identifier(schema, "ledger")
            with psycopg.connect(as_role(pg_url, owner), autocommit=True) as conn:
                conn.execute(sql.SQL("CREATE TABLE {} (event_id bigint NOT NULL)").format(ledger))
                conn.execute(
                    sql.SQL("GRANT INSERT ON {} TO {}").format(ledger, sql.Identifier(poller))
                )
                conn.execute(as_owner)

            # The app enqueues through its own connection.
            app_store = PostgresStore(as_role(pg_url, app), schema=schema)
            stores.append(app_store)
            with psycopg.connect(as_role(pg_url, app)) as conn, conn.transaction():
                ids = Outbox(app_store).enqueue_many(conn, [("order", {"n": n}) for n in range(48)])
                # keyed (the keys table) and deduplicated (the dedupe look-up), with the
                # page's grants
                keyed = Message("order", {"n": 48}, key="k", dedupe_key="order-48")
                ids += Outbox(app_store).enqueue_many(conn, [keyed, keyed])
                ids.append(Outbox(app_store).enqueue(conn, "order", {"n": 49}, key="k"))
            assert len(set(ids)) == 50
            with pytest.raises(StoreError, match="permission denied"):
                app_store.claim(batch_size=1, lease=timedelta(seconds=30), now=None)

            # The poller drains, its handler writing the ledger in the delivery transaction.
            bus = EventBus()
            insert = sql.SQL("INSERT INTO {} (event_id) VALUES (%s)").format(ledger)

            @bus.handler("order", name="ledger")
            def write_ledger(event: Event, ctx: Any) -> None:
                ctx.connection.execute(insert, (event.id,))

            poller_store = PostgresStore(as_role(pg_url, poller), schema=schema)
            stores.append(poller_store)
            poller_store.migrate()  # the schema is current: a no-op, allowed without DDL rights
            outbox = Outbox(poller_store, bus)
            runner = outbox.poller(batch_size=20)
            for _ in range(10):
                if not runner.run_once().claimed:
                    break
            stats = poller_store.stats(now=None)
            assert (stats.published, stats.pending, stats.dead) == (50, 0, 0)
            count = admin.execute(sql.SQL("SELECT count(*) FROM {}").format(ledger)).fetchone()
            assert count == (50,)

            # ... and may not change the schema.
            with psycopg.connect(as_role(pg_url, poller), autocommit=True) as conn:
                with pytest.raises(errors.InsufficientPrivilege):
                    conn.execute(
                        sql.SQL("CREATE TABLE {} (x int)").format(sql.Identifier(schema, "evil"))
                    )
                with pytest.raises(errors.InsufficientPrivilege):
                    conn.execute(
                        sql.SQL("ALTER TABLE {} ADD COLUMN evil int").format(
                            sql.Identifier(schema, "outbox_events")
                        )
                    )
                with pytest.raises(errors.InsufficientPrivilege):
                    conn.execute(
                        sql.SQL("DROP TABLE {}").format(sql.Identifier(schema, "outbox_deliveries"))
                    )
        finally:
            for store in stores:
                store.close()
            admin.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
            )
            for role in (owner, poller, app):
                drop_role(admin, role)
    roles = admin.execute(
        "SELECT count(*) FROM pg_roles WHERE rolname IN (%s, %s, %s)", (owner, poller, app)
    ).fetchone()
    assert roles == (0,)
