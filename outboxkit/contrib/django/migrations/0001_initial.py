"""The outbox tables, created by the store's own versioned migration (``Store.migrate``) in the
database ``settings.OUTBOXKIT["DATABASE"]`` names: one source of truth for the schema and its
versions, on SQLite and PostgreSQL alike. Later outboxkit versions add a migration that runs it
again (it is idempotent). Unapplying leaves the tables in place."""

from __future__ import annotations

from typing import Any

from django.db import migrations


def create_outbox_tables(apps: Any, schema_editor: Any) -> None:
    from outboxkit.contrib.django.conf import config
    from outboxkit.contrib.django.store import DjangoStore

    alias = schema_editor.connection.alias
    if alias != config().database:
        return
    store = DjangoStore(alias)
    try:
        store.migrate()
    finally:
        store.close()


class Migration(migrations.Migration):  # type: ignore[misc]  # Django has no type hints
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [
        migrations.RunPython(create_outbox_tables, migrations.RunPython.noop, elidable=False),
    ]
