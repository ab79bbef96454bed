"""Django's MySQL backend enqueues through its own connection, in its ``transaction.atomic()``
block (R1): committed → one event, rolled back → none. Django's backend wants mysqlclient's
``MySQLdb``; PyMySQL stands in for it (``pymysql.install_as_MySQLdb()``), so the app runs in a
process of its own, with settings of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from outboxkit_mysql import MySQLStore

from .server import connect_args

APP = textwrap.dedent(
    """
    import sys

    import pymysql

    pymysql.install_as_MySQLdb()

    import django
    from django.conf import settings

    host, port, user, password, name, url = sys.argv[1:]
    settings.configure(
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.mysql",
                "HOST": host, "PORT": port, "USER": user, "PASSWORD": password, "NAME": name,
            }
        },
        INSTALLED_APPS=[],
        USE_TZ=True,
    )
    django.setup()

    from django.db import connection, transaction

    from outboxkit import EventBus, Outbox, open_store

    outbox = Outbox(open_store(url), EventBus())
    with connection.cursor() as cur:
        cur.execute("CREATE TABLE orders (id INT PRIMARY KEY)")
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("INSERT INTO orders VALUES (1)")
        print(outbox.enqueue(connection, "order.placed", {"order": 1}, key="o1"))
    try:
        with transaction.atomic():
            with connection.cursor() as cur:
                cur.execute("INSERT INTO orders VALUES (2)")
            outbox.enqueue(connection, "order.placed", {"order": 2})
            raise RuntimeError("the view failed")
    except RuntimeError:
        pass
    outbox.store.close()
    """
)


def test_django_mysql_backend_enqueues_in_its_atomic_block(mysql_store: MySQLStore) -> None:
    url = mysql_store.url
    assert url is not None
    args = connect_args(url)
    database = url.rsplit("/", 1)[1]
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            APP,
            args["host"],
            str(args["port"]),
            args["user"],
            args["password"],
            database,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    (event,) = mysql_store.events()
    assert result.stdout.split() == [str(event.id)]
    assert (event.payload, event.key) == ({"order": 1}, "o1")
