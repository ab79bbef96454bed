"""Registers the Postgres store's URL schemes. Imports no driver until a store is opened."""
