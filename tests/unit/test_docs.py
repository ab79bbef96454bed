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
from tests.docs import DOCS, ROOT, blocks, page, python_blocks

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


# The other blocks (commands, SQL, ini files, the error tree), by page and language: each module
# named runs (or, for a command that serves until stopped, parses and starts) the page's blocks
# of that language, reading them from the page.
OTHER_BLOCKS_TESTED_BY: dict[tuple[str, str], list[str]] = {
    ("README.md", "bash"): ["tests/unit/test_docs.py"],
    ("index.md", "bash"): ["tests/unit/test_docs.py"],
    ("tutorials/first-test.md", "bash"): ["tests/unit/test_tutorials.py"],
    ("tutorials/production.md", "bash"): ["tests/integration/pg/test_tutorial_production.py"],
    ("writing-a-store.md", "bash"): [
        "tests/integration/test_example_store.py",
        "tests/integration/mysql/test_docs_mysql_commands.py",
    ],
    ("writing-a-store.md", "sql"): ["tests/unit/test_docs.py"],
    ("how-to/asyncio.md", "bash"): ["tests/unit/test_readme_asyncio.py"],
    ("how-to/asyncio.md", "ini"): ["tests/unit/test_readme_asyncio.py"],
    ("how-to/conformance.md", "bash"): ["tests/cli/test_docs_commands.py"],
    ("how-to/django.md", "bash"): ["tests/integration/django/test_django_readme.py"],
    ("how-to/django.md", "ini"): ["tests/integration/django/test_django_readme.py"],
    ("how-to/operations.md", "bash"): ["tests/cli/test_docs_commands.py"],
    ("how-to/postgresql.md", "sql"): ["tests/integration/pg/test_roles.py"],
    ("writing-a-store.md", "text"): [
        "tests/integration/test_example_store.py",
        "tests/integration/mysql/test_docs_mysql_commands.py",
    ],
    ("reference/errors.md", "text"): ["tests/unit/test_docs.py"],
    ("lifecycle.md", "text"): ["tests/unit/test_docs.py"],
    ("explanation/delivery.md", "text"): ["tests/unit/test_docs.py"],
    ("explanation/delivery.md", "mermaid"): ["tests/unit/test_docs.py"],
    ("explanation/architecture.md", "text"): ["tests/unit/test_docs.py"],
}
LANGUAGES = ("bash", "ini", "sql", "text", "mermaid")


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


def test_every_other_block_is_claimed() -> None:
    """Every block that is not Python (a command, SQL, an ini file, a drawing in text) is run or
    checked by a test that reads it from its page."""
    found = {
        (name, language)
        for name in pages()
        for language in LANGUAGES
        if blocks(page(name), language)
    }
    unclaimed = sorted(found - set(OTHER_BLOCKS_TESTED_BY))
    assert not unclaimed, f"blocks no test runs, by (page, language): {unclaimed}"
    for (name, language), modules in OTHER_BLOCKS_TESTED_BY.items():
        assert (name, language) in found, f"{name} has no {language} block (any more): drop it"
        for module in modules:
            source = (ROOT / module).read_text(encoding="utf-8")
            assert f'"{name}"' in source, f"{module} does not read {name}"
            assert f'"{language}"' in source, f"{module} reads no {language} block"
    untagged = [name for name in pages() if "" in fence_languages(page(name))]
    assert not untagged, f"code blocks without a language (no test would claim them): {untagged}"
    unknown = {
        (name, language)
        for name in pages()
        for language in fence_languages(page(name))
        if language not in ("python", *LANGUAGES)
    }
    assert not unknown, f"code blocks in a language this test does not look for: {unknown}"


def fence_languages(text: str) -> list[str]:
    """The language of every fenced block of ``text`` (``""`` for none), opening fences only."""
    found: list[str] = []
    inside = False
    for line in text.splitlines():
        fence = re.match(r"^\s*```(\S*)", line)
        if fence is not None:
            if not inside:
                found.append(fence.group(1))
            inside = not inside
    return found


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


# -- the blocks that are not Python ---------------------------------------------------------------


def ci_script() -> str:
    return (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def extras() -> set[str]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return set(project["optional-dependencies"])


def installed_extras(command: str) -> list[str]:
    """The extras a ``pip install`` line names: ``"outboxkit[pg]"``, ``".[dev]"``."""
    return [
        extra.strip()
        for group in re.findall(r"(?:outboxkit|\.)\[([\w,-]+)\]", command)
        for extra in group.split(",")
    ]


def test_readme_commands_are_the_ones_ci_runs() -> None:
    """The README's set-up, test, fault-tier and docs commands: CI runs each (``.ci/run``), the
    first two verbatim (``tests/cli/test_readme.py``); the large fault tier is a scale of the
    same command, which the fault suite reads."""
    first, develop, faults, docs = blocks(page("README.md"), "bash")
    ci = ci_script()
    assert "pip install ." in first and "python -m pytest -q -n 2" in first
    assert develop.splitlines() == [
        "python -m venv .venv && . .venv/bin/activate",
        'pip install -e ".[dev]"',
        "python -m pytest -q -n 2",
    ]
    assert re.search(r'pip install (-q )?-e "\.\[dev', ci), "CI installs the dev extra"
    assert re.search(r"^python -m pytest -q -n 2$", ci, flags=re.M)
    pr_tier, large_tier = (line.split("#")[0].strip() for line in faults.splitlines())
    # CI runs the PR tier as two groups at once: the relay file, and the rest of the tier.
    relay = "tests/faults/test_relay_faults.py"
    groups = re.findall(rf"^{re.escape(pr_tier)} (.*)$", ci, flags=re.M)
    assert len(groups) == 2, (pr_tier, groups)
    assert sorted(relay in group.split() for group in groups) == [False, True], groups
    assert sorted(f"--ignore={relay}" in group.split() for group in groups) == [False, True]
    scale, command = large_tier.split(" ", 1)
    assert command == pr_tier and scale == "OUTBOXKIT_FAULTS_SCALE=large"
    from tests.faults import _scale

    assert _scale.ENV == "OUTBOXKIT_FAULTS_SCALE"
    assert "large" in (ROOT / "tests" / "faults" / "_scale.py").read_text(encoding="utf-8")
    install, build = docs.splitlines()
    assert installed_extras(install) == ["docs"] and "docs" in extras()
    mkdocs, check = build.split(" && ")
    assert mkdocs == "mkdocs build --strict" and mkdocs in ci
    assert check == "python tools/check_reference.py site"
    assert re.search(r"^python tools/check_reference\.py ", ci, flags=re.M)
    for block in (first, develop):
        for extra in installed_extras(block):
            assert extra in extras(), extra


def test_install_lines_name_extras_that_exist() -> None:
    (line,) = blocks(page("index.md"), "bash")
    named = installed_extras(line)
    assert named == ["pg"]
    assert set(named) <= extras()


def test_the_mysql_excerpt_is_the_stores_sql() -> None:
    (excerpt,) = blocks(page("writing-a-store.md"), "sql")
    sql = (ROOT / "outboxkit_mysql" / "queries.sql").read_text(encoding="utf-8")
    at = 0
    for line in filter(None, (line.strip() for line in excerpt.splitlines())):
        found = sql.find(line, at)
        assert found >= 0, f"not in outboxkit_mysql/queries.sql (after offset {at}): {line}"
        at = found


def test_the_error_tree_is_the_class_tree() -> None:
    import outboxkit.errors as errors

    (tree,) = blocks(page("reference/errors.md"), "text")
    parents: list[type[BaseException]] = []
    named: list[str] = []
    for line in tree.splitlines():
        found = re.match(r"^([│├└─ ]*)(\w+)(?: \(also (\w+)\))?", line)
        assert found is not None, line
        prefix, name, also = found.groups()
        depth = len(prefix) // 4
        cls = getattr(errors, name)
        assert isinstance(cls, type) and issubclass(cls, BaseException), name
        del parents[depth:]
        if parents:
            assert cls.__bases__[0] is parents[-1], f"{name} is not under {parents[-1].__name__}"
        if also is not None:
            assert issubclass(cls, getattr(__import__("builtins"), also)), (name, also)
        parents.append(cls)
        named.append(name)
    documented = {
        name
        for name in errors.__all__
        if isinstance(getattr(errors, name), type)
        and issubclass(getattr(errors, name), errors.OutboxError)
    }
    assert documented <= set(named), f"errors missing from the tree: {documented - set(named)}"


def test_the_lifecycle_drawings_are_the_machines_table() -> None:
    from outboxkit.core.machine import TRANSITIONS, State

    states = {state.name for state in State}
    drawings = [
        *blocks(page("lifecycle.md"), "text"),
        *blocks(page("explanation/delivery.md"), "text"),
    ]
    assert len(drawings) == 2
    for drawing in drawings:
        assert set(re.findall(r"\b[A-Z]{4,}\b", drawing)) == states, drawing
    (diagram,) = blocks(page("explanation/delivery.md"), "mermaid")
    arrows = set(re.findall(r"^\s*(\w+) --> (\w+):", diagram, flags=re.M))
    assert arrows == {(start.name, end.name) for (start, _), end in TRANSITIONS.items()}
    table = set(re.findall(r"^\| (\w+)\s+\| [\w ]+\| (\w+)\s+\|", page("lifecycle.md"), re.M))
    assert table - {("from", "to")} == {
        (start.name, end.name) for (start, _), end in TRANSITIONS.items()
    }


def test_the_architecture_drawing_names_files_that_exist() -> None:
    (drawing,) = blocks(page("explanation/architecture.md"), "text")
    folder = ROOT
    checked = 0
    for line in drawing.splitlines():
        if not line.strip() or line.startswith(" " * 6):
            continue  # a description's next line
        name = line.split()[0]
        if not line.startswith(" "):
            path = ROOT / name
            folder = path if name.endswith("/") else ROOT
        else:
            path = folder / name
        assert path.exists(), f"the drawing names {name}, which is not at {path.relative_to(ROOT)}"
        checked += 1
    assert checked >= 15
    rules = re.findall(r"\*\*R(\d+) ", page("lifecycle.md"))
    assert f"the rules R1-R{max(map(int, rules))}" in drawing
