"""Clear refusals: the OUTBOXKIT setting, another database's connection, a broken atomic block."""

import contextlib

import pytest
from django.db import IntegrityError, connection, transaction
from shop.models import Order

from outboxkit import ConfigurationError, EventBus, Outbox
from outboxkit.contrib.django import DjangoStore
from outboxkit.contrib.django.conf import config


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (["default"], "settings.OUTBOXKIT must be a dict, got list"),
        ({"DATABSE": "default"}, "unknown key(s) ['DATABSE']"),
        (
            {"DATABASE": "nosuch"},
            "must name an alias of settings.DATABASES (['default']), got 'nosuch'",
        ),
        ({"OUTBOX": "shop.events.outbox"}, "'module:attribute'"),
        ({"STORE_OPTIONS": "prefix"}, "STORE_OPTIONS'] must be a dict, got str"),
    ],
)
def test_a_bad_setting_is_refused_naming_it(settings, value, message):
    settings.OUTBOXKIT = value
    with pytest.raises(ConfigurationError) as caught:
        config()
    assert message in str(caught.value)


def test_a_store_on_an_unknown_alias_is_refused_naming_it():
    with pytest.raises(ConfigurationError, match=r"'replica' is not in settings\.DATABASES"):
        DjangoStore("replica").stats(now=None)


@pytest.mark.django_db(transaction=True)
def test_another_databases_connection_is_refused_and_nothing_is_written():
    outbox = Outbox(DjangoStore("replica"), EventBus())
    with transaction.atomic():
        with pytest.raises(ConfigurationError, match=r"pass connections\['replica'\]"):
            outbox.enqueue(connection, "order.placed", {})
        Order.objects.create(item="still usable")
    assert Order.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_an_atomic_block_marked_for_rollback_is_refused(outbox, outbox_drain):
    # What this test enqueued (an earlier process test's committed events may be in the file).
    with outbox_drain.capture() as cap, transaction.atomic():
        Order.objects.create(id=1, item="book")
        with contextlib.suppress(IntegrityError):  # no savepoint: the block must roll back
            Order.objects.create(id=1, item="again")
        with pytest.raises(ConfigurationError, match="marked for rollback"):
            outbox.enqueue(connection, "order.placed", {})
    assert cap.enqueued() == []
