"""The PostgreSQL store for outboxkit (psycopg 3). Install with ``pip install outboxkit[pg]``."""
