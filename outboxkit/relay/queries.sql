-- The consumer-side inbox (outboxkit.relay.inbox): one row per (consumer, event id) applied.
-- {inbox} is the table's quoted name; values are bound.

-- name: create_sqlite
CREATE TABLE IF NOT EXISTS {inbox} (
    consumer TEXT NOT NULL,
    event_id INTEGER NOT NULL,
    received_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (consumer, event_id)
)

-- name: accept_sqlite
INSERT INTO {inbox} (consumer, event_id) VALUES (:consumer, :event_id)
ON CONFLICT (consumer, event_id) DO NOTHING

-- name: create_pg
CREATE TABLE IF NOT EXISTS {inbox} (
    consumer text NOT NULL,
    event_id bigint NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
)

-- name: accept_pg
INSERT INTO {inbox} (consumer, event_id) VALUES (%(consumer)s, %(event_id)s)
ON CONFLICT (consumer, event_id) DO NOTHING
