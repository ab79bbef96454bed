"""``outboxkit demo``: the example shop, shipped with outboxkit so that the demo runs from a plain
``pip install``.

- ``shop``: the shop itself, an order service on SQLite with three handlers;
- ``runner``: the shop end to end on a SQLite file (``main``), counting what happened;
- ``app``: the shop's outbox as an app module, ``outboxkit run outboxkit.cli.demo.app:outbox``;
- ``command``: the ``demo`` command, which runs ``runner.main`` and prints its tally.

The example's documentation and its tests are in ``examples/shop`` of the source tree.
"""
