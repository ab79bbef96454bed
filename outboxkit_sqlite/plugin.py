"""Registers the SQLite store's URL scheme."""
