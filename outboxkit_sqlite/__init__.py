"""The SQLite store for outboxkit: the embedded default."""
