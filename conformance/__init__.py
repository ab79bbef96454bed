"""The outboxkit store conformance suite (import name ``outboxkit_conformance``)."""
