-- The SQLite store's SQL, one named statement per block (loaded by outboxkit._sql.loader; the
-- statements the shared operations run are listed in outboxkit/_sql/base.py, with the same
-- names and parameters as the PostgreSQL store's).
--
-- Identifiers are slots: {events}, {deliveries}, {schema} (the tables), {events_due} and the
-- other names derived from the events table, {event_columns}. outboxkit_sqlite fills them with
-- double-quoted names that passed validate_identifier, and nothing else. Values are always
-- bound parameters, :name. Instants are INTEGER microseconds since the Unix epoch (UTC) and
-- durations integer microseconds: SQLite's own time functions are never used, so the clock the
-- outbox binds is the only clock. Arrays are JSON text, read with json_each.


-- name: create_purge_trigger
-- Schema version 4: an event's delivery records go with it (as ON DELETE CASCADE does on
-- PostgreSQL), so a purge is one statement; the trigger costs nothing but on a delete.
CREATE TRIGGER {events_purge} AFTER DELETE ON {events}
BEGIN
    DELETE FROM {deliveries} WHERE event_id = OLD.id;
END

-- name: schema_version
SELECT max(version) FROM {schema}

-- name: create_order_indexes
-- Schema version 5. R15: a keyed event is claimed only while no earlier event of its key
-- (by id: SQLite's single writer commits transactions in the order they took their ids) holds
-- the key up; the claim asks this index. R16: one event per dedupe key, until it is purged.
ALTER TABLE {events} ADD COLUMN dedupe_key TEXT;
CREATE INDEX {events_key} ON {events} (key, id) WHERE key IS NOT NULL AND published_at IS NULL;
CREATE UNIQUE INDEX {events_dedupe} ON {events} (dedupe_key) WHERE dedupe_key IS NOT NULL

-- name: insert_events_head
-- Each row's values end with the message identity, randomblob(16), drawn by SQLite itself
-- (outboxkit_sqlite.tables.insert_events): 16 random bytes, read back as a version 4 UUID's
-- text (outboxkit._sql.rows.message_id_text).
INSERT INTO {events} (topic, payload, headers, key, created_at, available_at, dedupe_key,
                      message_id) VALUES

-- name: insert_events_head_v5
-- insert_events_head for a schema at version 5 (a file opened with migrate=False, not yet
-- migrated): no message_id column yet; the rows keep NULL, their identity their decimal id.
INSERT INTO {events} (topic, payload, headers, key, created_at, available_at, dedupe_key) VALUES

-- name: create_message_id
-- Schema version 6: the message identity (see insert_events_head). Rows written before keep
-- NULL: their identity stays their decimal id, which their messages carried before.
ALTER TABLE {events} ADD COLUMN message_id BLOB

-- name: empty_tables
-- Every event and record gone, ids from 1 again: the test kit's emptying of a kept test file,
-- and the Django test store's between tests (statements run one by one).
DELETE FROM {deliveries};
DELETE FROM {events};
DELETE FROM sqlite_sequence WHERE name = :events_table

-- name: take_lock
-- A write that changes nothing: as a transaction's first statement it takes the write lock.
UPDATE {events} SET id = id WHERE 0

-- name: create_errors
-- Schema version 7: the error of each failed attempt (capabilities.error_history), a JSON array
-- of [attempt, at, error] that settle_many appends to when it keeps an error (a retry or a dead
-- letter), in the statement that writes last_error; attempt_errors reads it.
ALTER TABLE {events} ADD COLUMN errors TEXT

-- name: attempt_errors
-- The error of each failed attempt of one event, oldest first (see create_errors).
SELECT json_extract(x.value, '$[0]'), json_extract(x.value, '$[1]'), json_extract(x.value, '$[2]')
  FROM {events} AS e, json_each(e.errors) AS x
 WHERE e.id = :id
 ORDER BY x.key

-- name: insert_event_older
-- One event into a schema older than version 5 (a file opened with migrate=False, not yet
-- migrated): only the columns every version has.
INSERT INTO {events} (topic, payload, headers, key, created_at, available_at)
VALUES (?, ?, ?, ?, ?, ?) RETURNING id

-- name: dedupe_holders
-- R16: the events holding the given dedupe keys (a JSON array).
SELECT dedupe_key, id FROM {events} WHERE dedupe_key IN (SELECT value FROM json_each(:keys))

-- name: claim
-- R3: one atomic statement under BEGIN IMMEDIATE; the subquery's LIMIT keeps the batch size.
-- The handlers already recorded come back with each event (as a JSON array of pairs).
-- R15: a keyed event only while no earlier event of its key is unpublished and not dead (or,
-- with :hold, unpublished): one probe of the key index per keyed candidate.
UPDATE {events}
   SET attempts = attempts + 1,
       locked_until = :now + :lease,
       token = lower(hex(randomblob(16)))
 WHERE id IN (
       SELECT id FROM {events}
        WHERE published_at IS NULL AND failed_at IS NULL
          AND available_at <= :now
          AND (locked_until IS NULL OR locked_until <= :now)
          AND (key IS NULL OR NOT EXISTS (
                SELECT 1 FROM {events} AS b
                 WHERE b.key = {events}.key AND b.id < {events}.id
                   AND b.published_at IS NULL
                   AND (b.failed_at IS NULL OR :hold)))
        ORDER BY available_at, id
        LIMIT :batch_size)
RETURNING {event_columns}, token,
          (SELECT json_group_array(json_array(handler, outcome))
             FROM (SELECT handler, outcome FROM {deliveries} AS r
                    WHERE r.event_id = {events}.id ORDER BY r.rowid))

-- name: owned
-- R6: the delivery transaction's token check (it already holds the write lock).
SELECT 1 FROM {events}
 WHERE id = :id AND token = :token AND published_at IS NULL AND failed_at IS NULL

-- name: lock_claimed
-- R6 for a whole batch (transaction="per_batch"), at its first delivery that opens: the claims
-- whose tokens hold. The batch's transaction holds the database's one write lock from its
-- BEGIN IMMEDIATE to its end, so no token can change meanwhile: its deliveries check nothing
-- more (owned), and one whose token did not hold is refused without a statement.
SELECT id FROM {events}
 WHERE id IN (SELECT value FROM json_each(:ids))
   AND token IN (SELECT value FROM json_each(:tokens))
   AND published_at IS NULL AND failed_at IS NULL

-- name: insert_record_fenced
-- A delivery whose handler never used its connection (a non-transactional handler, a rejection,
-- a transactional handler that wrote nothing through ctx.connection) is this one autocommitted
-- statement: the token check and the record at once (R6); a stale token inserts nothing.
INSERT INTO {deliveries} (event_id, handler, outcome, attempt, recorded_at, reason)
SELECT id, :handler, :outcome, :attempt, :now, :reason
  FROM {events}
 WHERE id = :event_id AND token = :token AND published_at IS NULL AND failed_at IS NULL

-- name: insert_records_fenced
-- The records a batch's deliveries kept (see insert_record_fenced), written together before
-- the batch settles, each only if its event's token still holds: :items is a JSON array of
-- [event_id, token, handler, outcome, attempt, recorded_at, reason], in delivery order.
INSERT INTO {deliveries} (event_id, handler, outcome, attempt, recorded_at, reason)
SELECT e.id, json_extract(r.value, '$[2]'), json_extract(r.value, '$[3]'),
       json_extract(r.value, '$[4]'), json_extract(r.value, '$[5]'), json_extract(r.value, '$[6]')
  FROM json_each(:items) AS r
  JOIN {events} AS e ON e.id = json_extract(r.value, '$[0]')
                    AND e.token = json_extract(r.value, '$[1]')
 WHERE e.published_at IS NULL AND e.failed_at IS NULL
 ORDER BY r.key

-- name: insert_record
INSERT INTO {deliveries} (event_id, handler, outcome, attempt, recorded_at, reason)
VALUES (:event_id, :handler, :outcome, :attempt, :now, :reason)

-- name: extend
-- R13. extend and release reach their rows through the primary key (:ids) and are fenced by
-- the tokens: a token is unique to one claim of one event, so a row whose id is listed and
-- whose token is listed is exactly a row one of these claims still holds.
UPDATE {events} SET locked_until = :now + :lease
 WHERE id IN (SELECT value FROM json_each(:ids))
   AND token IN (SELECT value FROM json_each(:tokens))
   AND published_at IS NULL AND failed_at IS NULL
RETURNING token, locked_until

-- name: settle_many
-- R8 for a round's events in one statement, each fenced by its token: :items is a JSON array
-- of SETTLE_COLUMNS rows [id, token, publish, dead, retry_after, keeps_error, error]
-- (outboxkit._sql.rows.settle_row). RETURNING may not name the FROM table, so the settled rows
-- come back by id.
UPDATE {events}
   SET published_at = CASE WHEN s.publish THEN :now ELSE published_at END,
       failed_at = CASE WHEN s.dead THEN :now ELSE failed_at END,
       available_at = CASE WHEN s.retry_after IS NOT NULL
                           THEN :now + s.retry_after ELSE available_at END,
       last_error = CASE WHEN s.keeps_error THEN s.error ELSE last_error END,
       errors = CASE WHEN s.keeps_error AND s.error IS NOT NULL
                     THEN json_insert(coalesce(errors, '[]'), '$[#]',
                                      json_array(attempts, :now, s.error))
                     ELSE errors END,
       locked_until = NULL,
       token = NULL
  FROM (SELECT json_extract(value, '$[0]') AS id, json_extract(value, '$[1]') AS token,
               json_extract(value, '$[2]') AS publish, json_extract(value, '$[3]') AS dead,
               json_extract(value, '$[4]') AS retry_after,
               json_extract(value, '$[5]') AS keeps_error,
               json_extract(value, '$[6]') AS error
          FROM json_each(:items)) AS s
 WHERE {events}.id = s.id AND {events}.token = s.token
   AND published_at IS NULL AND failed_at IS NULL
RETURNING id

-- name: publish_many
-- settle_many when every event of the round is published (the usual round): the ids and the
-- tokens alone, as JSON arrays, and no CASE per row. Fenced as extend is: a row whose id is
-- listed and whose token is listed is a row one of these claims still holds.
UPDATE {events}
   SET published_at = :now, locked_until = NULL, token = NULL
 WHERE id IN (SELECT value FROM json_each(:ids))
   AND token IN (SELECT value FROM json_each(:tokens))
   AND published_at IS NULL AND failed_at IS NULL
RETURNING id

-- name: release
-- Unstarted claims handed back: lease cleared, the attempt refunded, fenced by token.
UPDATE {events}
   SET locked_until = NULL, token = NULL, attempts = max(0, attempts - 1)
 WHERE id IN (SELECT value FROM json_each(:ids))
   AND token IN (SELECT value FROM json_each(:tokens))
   AND published_at IS NULL AND failed_at IS NULL
RETURNING id

-- name: requeue
-- R12: dead events due again with attempts reset; their delivery records stay.
UPDATE {events}
   SET failed_at = NULL, attempts = 0, available_at = :now,
       locked_until = NULL, token = NULL
 WHERE id IN (SELECT value FROM json_each(:ids)) AND failed_at IS NOT NULL
RETURNING id

-- name: dead_letters
-- `failed_at >= coalesce(...)`, not `(:since IS NULL OR failed_at >= :since)`: SQLite seeks the
-- index to a bound it can compute, where the OR made it walk the index from its start (a read
-- paging through 300,000 dead letters by `since` went quadratic: 75 ms a page at the end).
SELECT {event_columns} FROM {events}
 WHERE failed_at IS NOT NULL
   AND (:topic IS NULL OR topic = :topic)
   AND failed_at >= coalesce(:since, -9223372036854775808)
 ORDER BY failed_at, id
 LIMIT :limit

-- name: get
SELECT {event_columns} FROM {events} WHERE id = :id

-- name: events
SELECT {event_columns} FROM {events}
 WHERE id > :after_id AND (:topic IS NULL OR topic = :topic)
 ORDER BY id
 LIMIT :limit

-- name: records
SELECT event_id, handler, outcome, attempt, recorded_at, reason FROM {deliveries}
 WHERE event_id IN (SELECT value FROM json_each(:ids))
 ORDER BY rowid

-- name: purge_published
-- One page; the delivery records go with their events (the {events_purge} trigger).
DELETE FROM {events}
 WHERE id IN (SELECT id FROM {events}
               WHERE published_at IS NOT NULL AND published_at < :before
               ORDER BY id LIMIT :limit)
RETURNING id

-- name: purge_dead
DELETE FROM {events}
 WHERE id IN (SELECT id FROM {events}
               WHERE failed_at IS NOT NULL
                 AND (:ids IS NULL OR id IN (SELECT value FROM json_each(:ids)))
                 AND (:before IS NULL OR failed_at < :before)
               ORDER BY id LIMIT :limit)
RETURNING id

-- name: stats
SELECT topic,
       CASE WHEN published_at IS NOT NULL THEN 'published'
            WHEN failed_at IS NOT NULL THEN 'dead'
            WHEN locked_until IS NOT NULL AND locked_until > :now THEN 'claimed'
            ELSE 'pending' END AS state,
       count(*),
       min(CASE WHEN published_at IS NULL AND failed_at IS NULL
                 AND (locked_until IS NULL OR locked_until <= :now)
                 AND available_at <= :now THEN available_at END)
  FROM {events}
 GROUP BY topic, state
-- The keys a dead event holds up under dead_key="hold" (fold_stats reads the NULL topic).
 UNION ALL
SELECT NULL, 'held_keys', count(DISTINCT key), NULL
  FROM {events}
 WHERE failed_at IS NOT NULL AND key IS NOT NULL
