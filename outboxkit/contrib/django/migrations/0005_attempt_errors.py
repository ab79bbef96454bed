"""The error of each failed attempt (PostgreSQL schema version 6, SQLite 7: ``errors``, which
the settlements append to): the store's own migration brings the tables up to its current schema
version, as 0001 to 0004 do; ``Store.migrate`` is idempotent."""

from __future__ import annotations

from importlib import import_module

from django.db import migrations

create_outbox_tables = import_module(
    "outboxkit.contrib.django.migrations.0001_initial"
).create_outbox_tables


class Migration(migrations.Migration):  # type: ignore[misc]  # Django has no type hints
    dependencies = [("outboxkit", "0004_message_id")]
    operations = [
        migrations.RunPython(create_outbox_tables, migrations.RunPython.noop, elidable=False),
    ]
