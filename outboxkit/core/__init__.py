"""The pure core of outboxkit: the event lifecycle and every decision about it.

RULE OF THIS FOLDER: every module here is pure. It imports only other modules of this folder
and ``outboxkit.errors``: no driver, no ``time`` or ``datetime.now``, no ``logging``, no
``pluggy``, no file or network I/O. Values come in as arguments (the instant included) and go
out as values or named errors. ``tests/unit/test_purity.py`` checks the rule on every file here.

Everything that decides what happens to an event lives here (``machine``); the pollers, the
stores and the test kit carry the decisions out.
"""
