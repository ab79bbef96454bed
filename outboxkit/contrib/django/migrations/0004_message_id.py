"""The message identity (PostgreSQL schema version 5, SQLite 6: ``message_id``, a random UUID
per event, which the relays send as the message's id): the store's own migration brings the
tables up to its current schema version, as 0001 to 0003 do; ``Store.migrate`` is idempotent."""

from __future__ import annotations

from importlib import import_module

from django.db import migrations

create_outbox_tables = import_module(
    "outboxkit.contrib.django.migrations.0001_initial"
).create_outbox_tables


class Migration(migrations.Migration):  # type: ignore[misc]  # Django has no type hints
    dependencies = [("outboxkit", "0003_claim_shape")]
    operations = [
        migrations.RunPython(create_outbox_tables, migrations.RunPython.noop, elidable=False),
    ]
