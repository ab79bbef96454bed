"""The outboxkit pytest plugin (entry point ``pytest11``). Fixtures arrive with the test kit."""
