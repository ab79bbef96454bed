"""Per-key ordering and dedupe keys: the store's own migration brings the tables up to its
current schema version (PostgreSQL 3, SQLite 5), as 0001 does; ``Store.migrate`` is
idempotent."""

from __future__ import annotations

from importlib import import_module

from django.db import migrations

create_outbox_tables = import_module(
    "outboxkit.contrib.django.migrations.0001_initial"
).create_outbox_tables


class Migration(migrations.Migration):  # type: ignore[misc]  # Django has no type hints
    dependencies = [("outboxkit", "0001_initial")]
    operations = [
        migrations.RunPython(create_outbox_tables, migrations.RunPython.noop, elidable=False),
    ]
