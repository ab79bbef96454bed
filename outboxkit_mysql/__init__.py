"""The MariaDB/MySQL store for outboxkit (``mysql://user:pass@host:3306/db``), on PyMySQL.

Built only on the public store seam, ``outboxkit.storekit``. See ``MySQLStore``.
"""

from __future__ import annotations

from .store import MySQLStore

__all__ = ["MySQLStore"]
