"""Every code block of the documentation runs in a test, by page.

A page's Python blocks are run by the test modules named for it in ``TESTED_BY`` (each of which
reads the page through ``tests.docs.page``); the blocks that are fragments of a larger program
(an observer to add, a retry loop) run here, each with the few names it assumes given. A page
with Python blocks that no test claims fails ``test_every_page_with_code_is_claimed``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from outboxkit import EventBus, Outbox, Poller, open_store
from tests.docs import DOCS, ROOT, page, python_blocks

TESTED_BY: dict[str, list[str]] = {
    "README.md": ["tests/unit/test_project.py"],
    "tutorials/first-test.md": ["tests/unit/test_tutorials.py"],
    "tutorials/production.md": ["tests/integration/pg/test_tutorial_production.py"],
    "writing-a-store.md": ["tests/unit/test_docs.py"],
    "how-to/asyncio.md": ["tests/unit/test_readme_asyncio.py"],
    "how-to/sqlalchemy.md": ["tests/integration/sqlalchemy/test_readme_sqlalchemy.py"],
    "how-to/django.md": [
        "tests/integration/django/test_django_readme.py",
        "tests/unit/test_docs.py",
    ],
    "how-to/sqlite.md": ["tests/integration/sqlite/test_readme_sqlite.py"],
    "how-to/postgresql.md": ["tests/integration/pg/test_readme_pg.py"],
    "how-to/mysql.md": ["tests/integration/mysql/test_readme_mysql.py"],
    "how-to/testing.md": [
        "tests/unit/test_project.py",
        "tests/unit/test_readme_testing.py",
        "tests/unit/test_docs.py",
    ],
    "how-to/conformance.md": ["tests/unit/test_docs.py"],
    "how-to/observing.md": ["tests/unit/test_docs.py"],
    "how-to/relays.md": ["tests/unit/test_docs.py", "tests/relay/test_docs_relays.py"],
    "explanation/delivery.md": ["tests/unit/test_docs.py"],
    "reference/errors.md": ["tests/integration/pg/test_docs_errors.py"],
}


def pages() -> list[str]:
    found = ["README.md"]
    found += sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))
    return found


def test_every_page_with_code_is_claimed() -> None:
    with_code = [name for name in pages() if python_blocks(page(name))]
    unclaimed = [name for name in with_code if name not in TESTED_BY]
    assert not unclaimed, f"pages whose Python blocks no test runs: {unclaimed}"
    for name, modules in TESTED_BY.items():
        assert name in with_code, f"{name} has no Python block (any more): drop it here"
        for module in modules:
            source = (ROOT / module).read_text(encoding="utf-8")
            assert f'"{name}"' in source, f"{module} does not read {name}"


def test_the_site_builds_these_pages() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    listed = set(re.findall(r":\s+([\w/.-]+\.md)\s*$", nav, flags=re.M))
    assert listed == set(pages()) - {"README.md"}, "a page missing from mkdocs.yml's nav"


def run(code: str, page_name: str, **given: Any) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "docs_block", **given}
    exec(compile(code, f"docs/{page_name}", "exec"), namespace)
    return namespace


@pytest.fixture
def outbox() -> Iterator[Outbox]:
    store = open_store("memory://")
    yield Outbox(store, EventBus())
    store.close()


# -- explanation/delivery.md ----------------------------------------------------------------------


def test_delivery_modes_block(outbox: Outbox) -> None:
    (modes, _) = python_blocks(page("explanation/delivery.md"))
    namespace = run(modes, "explanation/delivery.md", outbox=outbox)
    assert isinstance(namespace["poller"], Poller)
    assert namespace["poller"].options.transaction == "per_batch"


def test_ordering_dedupe_and_scheduling_block(tmp_path: Path) -> None:
    (_, ordering) = python_blocks(page("explanation/delivery.md"))
    store = open_store(f"sqlite:///{tmp_path / 'app.db'}")
    tomorrow_9am = datetime(2030, 1, 2, 9, tzinfo=UTC)
    try:
        with store.transaction() as tx:

            class Conn:  # the block's `with conn:`: the app's transaction, already open
                def __enter__(self) -> Any:
                    return tx

                def __exit__(self, *exc: object) -> None:
                    return None

            conn = Conn()
            namespace = run(
                ordering.replace("outbox.enqueue(conn,", "outbox.enqueue(tx,"),
                "explanation/delivery.md",
                Outbox=Outbox,
                store=store,
                bus=EventBus(),
                conn=conn,
                tx=tx,
                tomorrow_9am=tomorrow_9am,
            )
        events = store.events()
        assert [e.topic for e in events] == ["order.paid", "order.placed", "reminder"]
        assert events[0].key == "order-42"
        assert events[2].available_at == tomorrow_9am
        assert namespace["outbox"].dead_key == "release"
    finally:
        store.close()


# -- how-to/observing.md --------------------------------------------------------------------------


def test_observer_blocks(outbox: Outbox) -> None:
    alerts, logging_, tracing, metrics = python_blocks(page("how-to/observing.md"))
    paged: list[Any] = []

    @outbox.bus.handler("order.placed", name="fails")
    def fails(event: Any, ctx: Any) -> None:
        raise RuntimeError("down")

    run(alerts, "how-to/observing.md", outbox=outbox, page_someone=paged.append)
    run(logging_, "how-to/observing.md", outbox=outbox)
    with outbox.store.transaction() as tx:
        outbox.enqueue(tx, "order.placed", {"id": 1})
    outbox.poller(max_retries=0).run_once()
    assert [event.event_id for event in paged] == [1]  # the Alerts observer saw it dead

    namespace = run(
        tracing, "how-to/observing.md", Outbox=Outbox, store=outbox.store, bus=outbox.bus
    )
    assert isinstance(namespace["outbox"], Outbox)

    prometheus_client = pytest.importorskip("prometheus_client")
    before = set(prometheus_client.REGISTRY._collector_to_names)
    try:
        run(metrics, "how-to/observing.md", outbox=outbox)
        text = prometheus_client.generate_latest().decode()
        assert "outboxkit" in text
    finally:
        for collector in set(prometheus_client.REGISTRY._collector_to_names) - before:
            prometheus_client.REGISTRY.unregister(collector)


# -- how-to/relays.md -----------------------------------------------------------------------------


def test_relay_setup_block_builds_the_outbox_it_shows() -> None:
    (setup, _) = python_blocks(page("how-to/relays.md"))
    # The block's placeholders filled in: a store to open, one poll instead of running forever.
    code = setup.replace('"postgresql://..."', '"memory://"').replace(
        ".run_forever()", ".run_once()"
    )
    assert code != setup
    namespace = run(code, "how-to/relays.md")
    names = {spec.name for spec in namespace["bus"].specs()}
    assert {"to-rabbit", "to-nats", "to-redis"} <= names
    namespace["outbox"].store.close()


# -- how-to/testing.md, how-to/conformance.md, writing-a-store.md ---------------------------------


def test_testing_store_fixture_block(tmp_path: Path) -> None:
    fixture = python_blocks(page("how-to/testing.md"))[1]
    namespace = run(fixture, "how-to/testing.md", pytest=pytest, open_store=open_store)
    made = namespace["outbox_store"].__wrapped__(tmp_path)  # the fixture's function
    store = next(made)
    assert store.path == tmp_path / "app.db"
    with pytest.raises(StopIteration):
        next(made)


def test_conformance_blocks(tmp_path: Path) -> None:
    from outboxkit_conformance import StoreConformance

    def my_store(path: Path) -> Any:
        return open_store(f"sqlite:///{path}")

    for name in ("how-to/conformance.md", "writing-a-store.md"):
        block = python_blocks(page(name))[-1]
        namespace = run(block, name, MyStore=my_store)
        suite = namespace["TestMyStore"]
        assert issubclass(suite, StoreConformance)
        folder = tmp_path / name.replace("/", "-")
        folder.mkdir()
        store = suite().make_store(folder)
        assert store.capabilities.batches
        store.close()


def test_writing_a_store_excerpt_is_the_example_store() -> None:
    (excerpt, _) = python_blocks(page("writing-a-store.md"))
    example = (ROOT / "examples" / "dictstore" / "dictstore.py").read_text(encoding="utf-8")
    lines = [line.strip() for line in excerpt.splitlines()]
    shown = [line for line in lines if line and not line.startswith("...")]
    at = 0
    for line in shown:  # the excerpt's lines appear in the example, in order
        if line.startswith("from outboxkit.storekit import") or line == (
            "capabilities = Capabilities()"
        ):
            continue  # the tutorial's first step; the example imports and declares more
        if line.startswith("def "):
            line = line.split("(", 1)[0] + "("  # the example's signature carries its types
        found = example.find(line, at)
        assert found >= 0, f"not in examples/dictstore/dictstore.py (after offset {at}): {line}"
        at = found


# -- how-to/django.md -----------------------------------------------------------------------------


def test_django_settings_and_conftest_blocks_are_the_test_projects() -> None:
    blocks = python_blocks(page("how-to/django.md"))
    settings = next(b for b in blocks if b.startswith("# settings.py"))
    conftest = next(b for b in blocks if b.startswith("# conftest.py"))
    shown = run(settings, "how-to/django.md")
    project = (ROOT / "tests/integration/django/project/settings.py").read_text(encoding="utf-8")
    assert f"OUTBOXKIT = {shown['OUTBOXKIT']!r}".replace("'", '"') in project
    assert '"outboxkit.contrib.django"' in project and '"shop"' in project
    import_line = conftest.splitlines()[1]
    tested = (ROOT / "tests/integration/django/conftest.py").read_text(encoding="utf-8")
    assert import_line.strip() in tested
