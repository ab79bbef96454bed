-- The consumer-side inbox (outboxkit.relay.inbox): one row per (consumer, message id) applied.
-- {inbox} is the table's quoted name ({upgrading}: the name SQLite's upgrade builds the new
-- table under); values are bound. A message id is a relay message's identity: a UUID's text,
-- or the decimal event id of a message sent before the stores kept message ids.

-- name: create_sqlite
CREATE TABLE IF NOT EXISTS {inbox} (
    consumer TEXT NOT NULL,
    message_id TEXT NOT NULL,
    received_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (consumer, message_id)
)

-- name: columns_sqlite
SELECT name FROM pragma_table_info(:table)

-- name: upgrade_sqlite
-- An inbox table of the old format (event_id INTEGER) rebuilt with the text key, in the
-- caller's transaction: every applied id kept as its decimal text, the identity a message sent
-- before the upgrade carries, so that it is still a duplicate.
CREATE TABLE {upgrading} (
    consumer TEXT NOT NULL,
    message_id TEXT NOT NULL,
    received_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (consumer, message_id)
);
INSERT INTO {upgrading} (consumer, message_id, received_at)
SELECT consumer, CAST(event_id AS TEXT), received_at FROM {inbox};
DROP TABLE {inbox};
ALTER TABLE {upgrading} RENAME TO {inbox}

-- name: accept_sqlite
INSERT INTO {inbox} (consumer, message_id) VALUES (:consumer, :message_id)
ON CONFLICT (consumer, message_id) DO NOTHING

-- name: create_pg
CREATE TABLE IF NOT EXISTS {inbox} (
    consumer text NOT NULL,
    message_id text NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
)

-- name: old_format_pg
-- Whether the inbox table (as the search path finds it) is of the old format: an event_id
-- column. %(table)s is the table's name as a quoted identifier, bound as a value.
SELECT 1
  FROM pg_catalog.pg_attribute
 WHERE attrelid = to_regclass(%(table)s)
   AND attname = 'event_id'
   AND NOT attisdropped

-- name: lock_pg
LOCK TABLE {inbox} IN ACCESS EXCLUSIVE MODE

-- name: upgrade_pg
-- The old format's bigint event_id becomes the text message_id, in place: every applied id
-- kept as its decimal text (the identity a message sent before the upgrade carries), the
-- primary key rebuilt on the new column.
ALTER TABLE {inbox} RENAME COLUMN event_id TO message_id;
ALTER TABLE {inbox} ALTER COLUMN message_id TYPE text USING message_id::text

-- name: accept_pg
INSERT INTO {inbox} (consumer, message_id) VALUES (%(consumer)s, %(message_id)s)
ON CONFLICT (consumer, message_id) DO NOTHING
