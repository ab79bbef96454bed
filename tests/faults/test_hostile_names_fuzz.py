"""Hostile identifiers, fuzzed: every name option of both SQL stores, 1,000 examples each.

The options: ``PostgresStore``'s ``schema``, ``table_prefix``, ``events_table``,
``deliveries_table``, ``schema_table`` and ``channel``; ``SQLiteStore``'s ``table_prefix``,
``events_table``, ``deliveries_table`` and ``schema_table``. Names mix SQL metacharacters (quotes,
``;``, ``--``, ``/*``, NUL, ``$``, dots, whitespace), Unicode lookalikes of letters, digits and
``_``, names over 63 bytes, the empty name, and valid names.

The oracle, stated here independently of ``outboxkit.storekit.names.IDENTIFIER``: a valid name is 1 to
63 bytes of ASCII letters, digits and ``_``, not starting with a digit (the README's
``^[A-Za-z_][A-Za-z0-9_]{0,62}$``, read as a whole-string match: no trailing newline). For
``table_prefix`` the three names it makes (``{prefix}events``, ``{prefix}deliveries``,
``{prefix}schema``) must each be valid; a table name must also differ from the other two and from
the names of the objects the store derives from them (SQLite: the indexes ``{events}_due``,
``_token``, ``_failed``, ``_published``; PostgreSQL: ``{events}_due``, ``_published``, ``_dead``,
``_guard``, the primary keys ``{table}_pkey`` and the identity sequences ``{events}_id_seq``,
``{deliveries}_seq_seq``, each shortened to 63 bytes as PostgreSQL does). SQLite compares names
ignoring case and reserves ``sqlite_*`` (any case); PostgreSQL reserves ``pg_*`` schemas (refused
in any case) and ``information_schema``.

The property (the fuzz: ``test_*_names_are_accepted_iff_valid``, marked ``faults``: about 30 s
for the ten options): a name the oracle accepts builds a store (PostgreSQL: without connecting; SQLite:
its tables exist under exactly the names given); any other is refused at construction with a
``ConfigurationError`` naming the option and the bad value, before any connection is opened
(``psycopg`` and ``sqlite3`` connects are replaced by a tripwire while the refused store is
built). Afterwards a canary table in a fresh PostgreSQL schema and one in a SQLite file are intact,
and no schema or table named by the fuzz exists. ``open_store`` is checked on a fixed list of
hostile names, and valid edge names (63 bytes, upper case, SQL keywords, an empty prefix) are
migrated, notified and delivered on both servers; those run in the default tier.

The names the databases reserve or the store derives (``sqlite_*`` tables, names that differ only
in case on SQLite, a table named like one of the store's own indexes, ``pg_*`` schemas) used to
pass construction and fail late, in the database; they are refused at construction now, pinned by
the tests at the end of the module (default tier) as well as by the fuzz.
"""

from __future__ import annotations

import functools
import hashlib
import re
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn
from unittest.mock import patch

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from outboxkit import ConfigurationError, DeliveryContext, Event, EventBus, Outbox, open_store
from outboxkit_pg import PostgresStore
from outboxkit_sqlite import SQLiteStore

UNREACHABLE = "postgresql://nobody:secret-password@127.0.0.1:1/nowhere"

PG_OPTIONS = (
    "schema",
    "table_prefix",
    "events_table",
    "deliveries_table",
    "schema_table",
    "channel",
)
SQLITE_OPTIONS = ("table_prefix", "events_table", "deliveries_table", "schema_table")
TABLE_OPTIONS = ("events_table", "deliveries_table", "schema_table")
DEFAULT_TABLES = {
    "events_table": "outbox_events",
    "deliveries_table": "outbox_deliveries",
    "schema_table": "outbox_schema",
}
SUFFIXES = ("events", "deliveries", "schema")

FUZZ = settings(
    max_examples=1000,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# -- the oracle --------------------------------------------------------------------------------

_VALID = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)


def valid_identifier(name: str) -> bool:
    """1-63 bytes; ASCII letters, digits, ``_``; no leading digit (whole string)."""
    return 1 <= len(name.encode("utf-8", "surrogatepass")) <= 63 and bool(_VALID.fullmatch(name))


def kw(option: str, name: str) -> dict[str, Any]:
    """``{option: name}``, as keyword arguments for a store."""
    return {option: name}


def prefixed(prefix: str) -> tuple[str, str, str]:
    return (f"{prefix}events", f"{prefix}deliveries", f"{prefix}schema")


SQLITE_INDEXES = ("due", "token", "failed", "published")  # on the events table
PG_DERIVED = {  # indexes, guard trigger/function, primary keys, identity sequences
    "events_table": ("due", "published", "dead", "guard", "pkey", "id_seq"),
    "deliveries_table": ("pkey", "seq_seq"),
    "schema_table": ("pkey",),
}


def pg_derived(table: str, suffix: str) -> str:
    """PostgreSQL's ``{table}_{suffix}`` within 63 bytes (the table part shortened)."""
    return table[: 63 - len(suffix) - 1] + "_" + suffix


def accepted(option: str, name: str, store: str) -> bool:
    """Whether the documented rules accept ``name`` for ``option`` (the others left default)
    on ``store`` (``"pg"`` or ``"sqlite"``)."""
    if option == "schema":
        reserved = name.lower().startswith("pg_") or name.lower() == "information_schema"
        return valid_identifier(name) and not reserved
    if option == "channel":
        return valid_identifier(name)
    tables = table_names(option, name)
    if not all(valid_identifier(table) for table in tables.values()):
        return False
    fold = str.lower if store == "sqlite" else str
    if len({fold(table) for table in tables.values()}) != 3:
        return False
    if store == "sqlite":
        if any(table.lower().startswith("sqlite_") for table in tables.values()):
            return False
        derived = {f"{tables['events_table']}_{s}".lower() for s in SQLITE_INDEXES}
        if any(index.startswith("sqlite_") for index in derived):  # events table "sqlite"
            return False
    else:
        derived = {
            pg_derived(tables[table_option], suffix)
            for table_option, suffixes in PG_DERIVED.items()
            for suffix in suffixes
        }
    return not any(fold(table) in derived for table in tables.values())


def shown(option: str, name: str) -> list[str]:
    """What a refusal may show of the bad value (reprs are shortened to 80 characters); for a
    prefix, the table name it made."""
    values = [name + suffix for suffix in SUFFIXES] if option == "table_prefix" else [name]
    return [repr(value)[:80] for value in values]


def check_refusal(error: ConfigurationError, option: str, name: str) -> None:
    message = str(error)
    assert option in message, f"{message!r} does not name {option}"
    assert any(part in message for part in shown(option, name)), (
        f"{message!r} does not show the bad value {name!r}"
    )


# -- the names -----------------------------------------------------------------------------------

METACHARS = [
    "'", '"', ";", "--", "/*", "*/", "\x00", " ", "\t", "\n", "\r", ".", "$", "$1", "$$",
    "\\", "(", ")", ",", "`", "[", "]", "%", "%s", "{", "}", "-", "=", "@", "#", ":",
    "\u200b", "\ufeff", "\u00a0",
]  # fmt: skip
LOOKALIKES = [
    "\uff41",  # fullwidth a
    "\u0430",  # Cyrillic a
    "\u03bf",  # Greek omicron
    "\u0131",  # dotless i
    "\u017f",  # long s (matches "s" under IGNORECASE)
    "\u212a",  # Kelvin sign (matches "k" under IGNORECASE)
    "\uff3f",  # fullwidth low line
    "\u0663",  # Arabic-Indic three (a \d digit)
    "\U0001d7d8",  # mathematical double-struck zero
    "\u00e9", "e\u0301", "\u00df", "\u2024", "\u037e",  # é, e + combining, ß, one-dot leader, Greek ;
]  # fmt: skip
HOSTILE = [
    'x"; DROP TABLE canary; --',
    "canary; DROP SCHEMA public CASCADE",
    "x'); DELETE FROM canary; --",
    "outbox_events; --",
    "a/*b*/",
    "public.canary",
    "a.b",
    "",
    " ",
    "abc\n",
    "1abc",
    "$1",
    "a\x00b",
    "x" * 64,
    "\u00e9" * 32,  # 32 characters, 64 bytes
    "\uff46\uff55\uff4c\uff4c",
]
ATOMS = [*METACHARS, *LOOKALIKES, "a", "Z", "_", "0", "9", "select", "DROP", "outbox_", "public"]

valid_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,62}", fullmatch=True)


def _insert(parts: tuple[str, str, int]) -> str:
    name, bad, at = parts
    at = min(at, len(name))
    return name[:at] + bad + name[at:]


hostile_names = st.one_of(
    valid_names,
    st.tuples(valid_names, st.sampled_from(METACHARS + LOOKALIKES), st.integers(0, 63)).map(
        _insert
    ),
    st.sampled_from(HOSTILE),
    st.lists(st.sampled_from(ATOMS), max_size=8).map("".join),
    st.integers(min_value=50, max_value=140).map(lambda n: "a" * n),  # around the 63-byte bound
    st.integers(min_value=20, max_value=70).map(lambda n: "_" + "\u00e9" * n),
    st.text(max_size=80),
)


# -- helpers -------------------------------------------------------------------------------------


class Touched(Exception):
    """The tripwire: a store tried to connect."""


@contextmanager
def tripwire() -> Iterator[list[str]]:
    """Every ``psycopg``/``sqlite3`` connect raises ``Touched`` (and is listed)."""
    calls: list[str] = []

    def refuse(*args: object, **kwargs: object) -> NoReturn:
        calls.append(repr(args)[:80])
        raise Touched

    with (
        patch.object(psycopg, "connect", refuse),
        patch.object(psycopg.Connection, "connect", refuse),
        patch.object(sqlite3, "connect", refuse),
    ):
        yield calls


def build(factory: Callable[[], object]) -> object:
    """``factory()`` under the tripwire: the store, ``Touched`` (it got as far as connecting),
    or the ``ConfigurationError`` (raised before any connect)."""
    with tripwire() as calls:
        try:
            return factory()
        except ConfigurationError as exc:
            assert calls == [], f"refused only after connecting: {calls}"
            return exc
        except Touched:
            return Touched()


def table_names(option: str, name: str) -> dict[str, str]:
    if option == "table_prefix":
        return dict(zip(TABLE_OPTIONS, prefixed(name), strict=True))
    return {**DEFAULT_TABLES, **({option: name} if option in TABLE_OPTIONS else {})}


def sqlite_shape(path: Path) -> tuple[Any, ...]:
    with sqlite3.connect(path) as conn:
        shape = (
            conn.execute(
                "SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY 2"
            ).fetchall(),
            conn.execute("SELECT id, note FROM canary ORDER BY id").fetchall(),
            conn.execute("PRAGMA journal_mode").fetchone(),
        )
    conn.close()
    return shape


def pg_shape(admin: psycopg.Connection[Any], schema: str) -> tuple[set[str], set[tuple[str, str]]]:
    """The server's schemas, and its relations in ``schema`` and ``public``."""
    schemas = {row[0] for row in admin.execute("SELECT nspname FROM pg_namespace")}
    relations = admin.execute(
        "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname IN (%s, 'public')",
        (schema,),
    ).fetchall()
    return schemas, {(nsp, rel) for nsp, rel in relations}


def canary_rows(admin: psycopg.Connection[Any], schema: str) -> list[Any]:
    return admin.execute(
        sql.SQL("SELECT id, note FROM {} ORDER BY id").format(sql.Identifier(schema, "canary"))
    ).fetchall()


# -- SQLite --------------------------------------------------------------------------------------


@pytest.fixture
def sqlite_canary(tmp_path: Path) -> Path:
    path = tmp_path / "canary.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE canary (id INTEGER PRIMARY KEY, note TEXT)")
        conn.executemany("INSERT INTO canary VALUES (?, ?)", [(1, "a"), (2, "b"), (3, "c")])
    conn.close()
    return path


@pytest.mark.faults
@pytest.mark.parametrize("option", SQLITE_OPTIONS)
def test_sqlite_names_are_accepted_iff_valid(sqlite_canary: Path, option: str) -> None:
    before = sqlite_shape(sqlite_canary)
    digest = hashlib.sha256(sqlite_canary.read_bytes()).hexdigest()
    seen = {"accepted": 0, "refused": 0}

    @FUZZ
    @given(name=hostile_names)
    def check(name: str) -> None:
        expected = accepted(option, name, "sqlite")
        outcome = build(lambda: SQLiteStore(sqlite_canary, **kw(option, name)))
        if expected:
            assert isinstance(outcome, Touched), f"{option}={name!r} refused: {outcome!r}"
        else:
            assert isinstance(outcome, ConfigurationError), (
                f"{option}={name!r} not refused: {outcome!r}"
            )
            check_refusal(outcome, option, name)
        seen["accepted" if expected else "refused"] += 1
        if expected:  # and the tables exist under exactly these names
            tables = table_names(option, name)
            with SQLiteStore(":memory:", **kw(option, name)) as store, store.transaction() as conn:
                found = {
                    r[0]
                    for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                }
            assert found - {"sqlite_sequence"} == set(tables.values())

    check()
    assert seen["accepted"] >= 50 and seen["refused"] >= 500, seen
    assert sqlite_shape(sqlite_canary) == before
    assert hashlib.sha256(sqlite_canary.read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in sqlite_canary.parent.iterdir()) == ["canary.db"]  # no -wal


# -- PostgreSQL ----------------------------------------------------------------------------------


@pytest.mark.pg
@pytest.mark.faults
@pytest.mark.parametrize("option", PG_OPTIONS)
def test_pg_names_are_accepted_iff_valid(
    pg_url: str, pg_schema: str, admin: psycopg.Connection[Any], option: str
) -> None:
    admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(pg_schema)))
    admin.execute(
        sql.SQL("CREATE TABLE {} (id int PRIMARY KEY, note text)").format(
            sql.Identifier(pg_schema, "canary")
        )
    )
    admin.execute(
        sql.SQL("INSERT INTO {} VALUES (1, 'a'), (2, 'b'), (3, 'c')").format(
            sql.Identifier(pg_schema, "canary")
        )
    )
    rows = canary_rows(admin, pg_schema)
    schemas_before, relations_before = pg_shape(admin, pg_schema)
    fuzzed: set[str] = set()
    seen = {"accepted": 0, "refused": 0}

    @FUZZ
    @given(name=hostile_names)
    def check(name: str) -> None:
        fuzzed.add(name)
        fuzzed.update(prefixed(name))
        expected = accepted(option, name, "pg")
        factories: list[Callable[[], object]] = [
            lambda: PostgresStore(UNREACHABLE, **kw(option, name))
        ]
        if option != "schema":  # the real server, next to the canary
            factories.append(lambda: PostgresStore(pg_url, schema=pg_schema, **kw(option, name)))
        for factory in factories:
            outcome = build(factory)
            if expected:
                assert isinstance(outcome, PostgresStore), f"{option}={name!r}: {outcome!r}"
                tables = table_names(option, name)
                names = outcome.names
                assert (names.events, names.deliveries, names.versions) == tuple(tables.values())
                if option == "schema":
                    assert names.schema == name
                assert names.channel == (name if option == "channel" else names.events)
                outcome.close()
            else:
                assert isinstance(outcome, ConfigurationError), (
                    f"{option}={name!r} not refused: {outcome!r}"
                )
                check_refusal(outcome, option, name)
        seen["accepted" if expected else "refused"] += 1

    check()
    assert seen["accepted"] >= 50 and seen["refused"] >= 500, seen
    assert canary_rows(admin, pg_schema) == rows
    schemas_after, relations_after = pg_shape(admin, pg_schema)
    assert (schemas_after - schemas_before) & fuzzed == set()
    assert {(nsp, rel) for nsp, rel in relations_after - relations_before if rel in fuzzed} == set()
    assert {rel for nsp, rel in relations_after if nsp == pg_schema} == {"canary", "canary_pkey"}


@pytest.mark.parametrize("name", HOSTILE)
def test_open_store_refuses_like_the_constructors(tmp_path: Path, name: str) -> None:
    # open_store builds a plugin manager per call (a few ms): the fixed list, not the fuzz.
    path = tmp_path / "never.db"
    stores = (("pg", UNREACHABLE, PG_OPTIONS), ("sqlite", f"sqlite:///{path}", SQLITE_OPTIONS))
    for store, url, options in stores:
        for option in (o for o in options if not accepted(o, name, store)):  # "" is a valid prefix
            outcome = build(functools.partial(open_store, url, **kw(option, name)))
            assert isinstance(outcome, ConfigurationError), f"{url} {option}={name!r}: {outcome!r}"
            check_refusal(outcome, option, name)
    assert not path.exists()


# Valid edge names on the real servers: migrated, an event enqueued, notified and delivered.
TAG = uuid.uuid4().hex[:8]
EDGE_NAMES: list[dict[str, Any]] = [
    {"schema": f"OKT_Fuzz_{TAG}"},  # upper case: a quoted, case-sensitive schema
    {"schema": f"okt_fuzz_{TAG}_".ljust(63, "z")},  # 63 bytes
    {"events_table": "E" * 63, "deliveries_table": "D" * 63, "schema_table": "S" * 63},
    {
        "events_table": "select",
        "deliveries_table": "from",
        "schema_table": "user",
        "channel": "order",
    },
    {"table_prefix": "P" * 53},  # Pdeliveries: 63 bytes
    {"table_prefix": "", "channel": "_"},
    {"table_prefix": "_Outbox_", "channel": "Outbox_Channel"},  # case kept in LISTEN and NOTIFY
    {"events_table": "outbox_deliveries_", "channel": "C" * 63},
]


def _deliver(store: PostgresStore | SQLiteStore, enqueue: Callable[[Outbox], None]) -> list[int]:
    bus = EventBus()
    delivered: list[int] = []

    @bus.handler("fuzz.edge", name="edge")
    def edge(event: Event, ctx: DeliveryContext) -> None:
        delivered.append(event.payload["n"])

    outbox = Outbox(store, bus)
    enqueue(outbox)
    outbox.poller().run_once()
    return delivered


@pytest.mark.pg
@pytest.mark.parametrize("options", EDGE_NAMES, ids=lambda o: ",".join(o))
def test_pg_valid_edge_names_work(
    pg_url: str, pg_schema: str, admin: psycopg.Connection[Any], options: dict[str, Any]
) -> None:
    schema = options.get("schema", pg_schema)
    store = PostgresStore(pg_url, **{"schema": pg_schema, **options})
    try:
        store.migrate()
        names = store.names
        admin.execute(sql.SQL("LISTEN {}").format(sql.Identifier(names.channel)))

        def enqueue(outbox: Outbox) -> None:
            with store.transaction() as conn:
                outbox.enqueue(conn, "fuzz.edge", {"n": 7})

        assert _deliver(store, enqueue) == [7]
        # Only names.channel is listened to, but channels are the database's, not a schema's:
        # a test running beside this one may notify the default channel at the same moment.
        heard = {n.channel for n in admin.notifies(timeout=5, stop_after=1)}
        assert heard == {names.channel}
        tables = admin.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s AND c.relkind = 'r'",
            (schema,),
        ).fetchall()
        assert {t for (t,) in tables} == {
            names.events,
            names.deliveries,
            names.versions,
            names.keys,
        }
    finally:
        admin.execute("UNLISTEN *")
        store.close()
        if schema != pg_schema:
            admin.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
            )
    left = admin.execute(
        "SELECT count(*) FROM pg_namespace WHERE nspname = %s", (schema,)
    ).fetchone()
    assert left == (0,) or schema == pg_schema


SQLITE_EDGE_NAMES = [
    {k: v for k, v in o.items() if k in SQLITE_OPTIONS}
    for o in EDGE_NAMES
    if any(k in SQLITE_OPTIONS for k in o)
]


@pytest.mark.parametrize("options", SQLITE_EDGE_NAMES, ids=lambda o: ",".join(o))
def test_sqlite_valid_edge_names_work(tmp_path: Path, options: dict[str, Any]) -> None:
    path = tmp_path / "edge.db"
    with SQLiteStore(path, **options) as store:

        def enqueue(outbox: Outbox) -> None:
            with store.transaction() as conn:
                outbox.enqueue(conn, "fuzz.edge", {"n": 7})

        assert _deliver(store, enqueue) == [7]
        tables = store.tables
    with sqlite3.connect(path) as conn:
        found = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    conn.close()
    assert found - {"sqlite_sequence"} == {tables.events, tables.deliveries, tables.schema}


# -- reserved and derived names: refused at construction (they used to fail late, in the database) --

SQLITE_REFUSED: list[tuple[str, str]] = [
    ("table_prefix", "sqlite_"),
    ("table_prefix", "SQLite_"),
    ("events_table", "sqlite_outbox"),
    ("deliveries_table", "SQLITE_deliveries"),
    ("schema_table", "Sqlite_Schema"),
    ("events_table", "OUTBOX_DELIVERIES"),  # equal to the deliveries table, ignoring case
    ("schema_table", "Outbox_Events"),
    *(("deliveries_table", f"outbox_events_{s}") for s in SQLITE_INDEXES),
    ("schema_table", "OUTBOX_EVENTS_DUE"),
    ("events_table", "SQLITE"),  # its indexes would be SQLITE_due ... (found by the fuzz)
    ("events_table", "sqlite"),
]


@pytest.mark.parametrize(("option", "name"), SQLITE_REFUSED, ids=str)
def test_sqlite_reserved_and_derived_names_are_refused_at_construction(
    tmp_path: Path, option: str, name: str
) -> None:
    assert not accepted(option, name, "sqlite")  # the oracle agrees
    path = tmp_path / "refused.db"
    outcome = build(lambda: SQLiteStore(path, **kw(option, name)))
    assert isinstance(outcome, ConfigurationError), outcome
    check_refusal(outcome, option, name)
    assert not path.exists()


def test_sqlite_names_a_derived_index_clash_on_both_options(tmp_path: Path) -> None:
    # Both tables chosen: the refusal names the table option and the events table it came from.
    with pytest.raises(ConfigurationError) as raised:
        SQLiteStore(tmp_path / "x.db", events_table="jobs", deliveries_table="Jobs_Token")
    message = str(raised.value)
    assert "deliveries_table" in message and "'Jobs_Token'" in message
    assert "events_table 'jobs'" in message and "'jobs_token'" in message


PG_REFUSED: list[tuple[str, str]] = [
    ("schema", "pg_outbox"),
    ("schema", "PG_Outbox"),
    ("schema", "pg_"),
    ("schema", "information_schema"),
    ("schema", "INFORMATION_SCHEMA"),
    *(
        ("deliveries_table", f"outbox_events_{s}")
        for s in ("due", "published", "dead", "guard", "pkey", "id_seq")
    ),
    ("schema_table", "outbox_events_due"),
    ("events_table", "outbox_schema_pkey"),
    ("events_table", "outbox_deliveries_seq_seq"),
]


@pytest.mark.parametrize(("option", "name"), PG_REFUSED, ids=str)
def test_pg_reserved_and_derived_names_are_refused_at_construction(option: str, name: str) -> None:
    assert not accepted(option, name, "pg")  # the oracle agrees
    outcome = build(lambda: PostgresStore(UNREACHABLE, **kw(option, name)))
    assert isinstance(outcome, ConfigurationError), outcome
    check_refusal(outcome, option, name)


def test_pg_derived_names_are_shortened_like_postgresql() -> None:
    # A 63-byte events table: its due index is the first 59 bytes plus "_due".
    events = "E" * 63
    outcome = build(
        lambda: PostgresStore(UNREACHABLE, events_table=events, deliveries_table="E" * 59 + "_due")
    )
    assert isinstance(outcome, ConfigurationError), outcome
    check_refusal(outcome, "deliveries_table", "E" * 59 + "_due")


@pytest.mark.parametrize(
    "options",
    [
        {"schema": "pgx_outbox"},  # pg without the underscore
        {"schema": "my_pg_outbox"},
        {"deliveries_table": "outbox_events_due2"},
        {"events_table": "Outbox_Deliveries"},  # PostgreSQL keeps case (quoted identifiers)
        {"table_prefix": "sqlite"},  # sqliteevents: no underscore
    ],
    ids=str,
)
def test_pg_names_near_the_reserved_ones_are_accepted(options: dict[str, Any]) -> None:
    assert all(accepted(option, name, "pg") for option, name in options.items())
    outcome = build(lambda: PostgresStore(UNREACHABLE, **options))
    assert isinstance(outcome, PostgresStore), outcome
    outcome.close()
