-- The MariaDB/MySQL store's SQL (outboxkit.storekit.queries; names and parameters as
-- outboxkit.storekit.sql lists them). Slots: {events}, {deliveries}, {keys}, {schema} (quoted,
-- validated names), {event_columns}, {now} (the bound instant, else UTC_TIMESTAMP(6)). Values
-- are bound. Instants DATETIME(6) UTC; durations microseconds; lists tuples or JSON text.
-- No UPDATE ... RETURNING: a block of steps (each ending with ';' at a line's end) is run by
-- run_steps: a step's rows, picked and locked FOR UPDATE, are %(picked)s for the steps after.

-- name: create_versions
CREATE TABLE IF NOT EXISTS {schema} (
    version INT NOT NULL PRIMARY KEY,
    applied_at DATETIME(6) NOT NULL
) ENGINE=InnoDB

-- name: migration_1
-- R15: one row per ordering key (upsert_key).
CREATE TABLE IF NOT EXISTS {keys} (
    `key` VARCHAR(255) NOT NULL PRIMARY KEY,
    seq BIGINT NOT NULL
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;
CREATE TABLE IF NOT EXISTS {events} (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    topic VARCHAR(255) NOT NULL,
    payload LONGTEXT NOT NULL,
    headers TEXT NOT NULL,
    `key` VARCHAR(255) NULL,
    key_seq BIGINT NULL,
    created_at DATETIME(6) NOT NULL,
    available_at DATETIME(6) NOT NULL,
    attempts INT NOT NULL DEFAULT 0,
    published_at DATETIME(6) NULL,
    failed_at DATETIME(6) NULL,
    locked_until DATETIME(6) NULL,
    token CHAR(32) NULL,
    last_error TEXT NULL,
    message_id CHAR(36) NOT NULL,
    dedupe_key VARCHAR(255) NULL,
    KEY due (published_at, failed_at, available_at),
    KEY key_order (`key`, key_seq),
    KEY settled (published_at),
    UNIQUE KEY dedupe (dedupe_key)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;
CREATE TABLE IF NOT EXISTS {deliveries} (
    seq BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    event_id BIGINT NOT NULL,
    handler VARCHAR(255) NOT NULL,
    outcome VARCHAR(16) NOT NULL,
    attempt INT NOT NULL,
    recorded_at DATETIME(6) NOT NULL,
    reason TEXT NULL,
    UNIQUE KEY event_handler (event_id, handler)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin

-- name: schema_version
SELECT COALESCE(MAX(version), 0) FROM {schema}

-- name: record_version
INSERT IGNORE INTO {schema} (version, applied_at) VALUES (%(version)s, UTC_TIMESTAMP(6))

-- name: drop_tables
DROP TABLE IF EXISTS {deliveries}, {events}, {keys}, {schema}

-- name: clock
SELECT UTC_TIMESTAMP(6)

-- name: upsert_key
-- R15: the key's next number, its row locked until the enqueuing transaction ends.
INSERT INTO {keys} (`key`, seq) VALUES (%(key)s, 1) ON DUPLICATE KEY UPDATE seq = seq + 1

-- name: insert_event
-- R1. R16: a taken dedupe key makes this a no-op whose LAST_INSERT_ID is the holder's id.
INSERT INTO {events} (topic, payload, headers, `key`, key_seq, created_at, available_at,
                      message_id, dedupe_key)
VALUES (%(topic)s, %(payload)s, %(headers)s, %(key)s,
        (SELECT seq FROM {keys} WHERE `key` = %(key)s),
        {now}, COALESCE(CAST(%(at)s AS DATETIME(6)), {now} + INTERVAL %(delay)s MICROSECOND),
        %(message_id)s, %(dedupe_key)s)
ON DUPLICATE KEY UPDATE id = LAST_INSERT_ID(id)

-- name: last_insert_id
-- The id insert_event wrote, or (R16) the holder's of its taken dedupe key, in this session: what
-- an enqueue through SQLAlchemy reads after each event (portable_enqueue).
SELECT LAST_INSERT_ID()

-- name: claim
-- R3: due rows, oldest first, locked (others skip them), leased. R15: a keyed event only
-- while no earlier one of its key (key_seq: commit order) is unsettled (%(hold)s: unpublished).
SELECT e.id FROM {events} AS e
 WHERE e.published_at IS NULL AND e.failed_at IS NULL
   AND e.available_at <= {now}
   AND (e.locked_until IS NULL OR e.locked_until <= {now})
   AND (e.`key` IS NULL OR NOT EXISTS (
         SELECT 1 FROM {events} AS b
          WHERE b.`key` = e.`key` AND b.key_seq < e.key_seq
            AND b.published_at IS NULL AND (b.failed_at IS NULL OR %(hold)s)))
 ORDER BY e.available_at, e.id
 LIMIT %(batch_size)s
   FOR UPDATE SKIP LOCKED;
UPDATE {events}
   SET attempts = attempts + 1,
       locked_until = {now} + INTERVAL %(lease)s MICROSECOND,
       token = REPLACE(UUID(), '-', '')
 WHERE id IN %(picked)s;
SELECT {event_columns}, token,
       (SELECT JSON_ARRAYAGG(JSON_ARRAY(r.handler, r.outcome) ORDER BY r.seq)
          FROM {deliveries} AS r WHERE r.event_id = {events}.id)
  FROM {events}
 WHERE id IN %(picked)s

-- name: owned
-- R6: the token check and the row lock, first in a delivery. INTO a variable: the answer is an
-- OK packet whose row count (1, or 0 for a stale token) says it, not a result set to parse.
SELECT id INTO @outboxkit_owned FROM {events}
 WHERE id = %(id)s AND token = %(token)s AND published_at IS NULL AND failed_at IS NULL
   FOR UPDATE

-- name: lock_claimed
-- R6 for a whole batch, at its start (Batch.claimed): the rows whose tokens hold, locked.
SELECT id FROM {events}
 WHERE id IN %(ids)s AND token IN %(tokens)s AND published_at IS NULL AND failed_at IS NULL
   FOR UPDATE

-- name: insert_record
INSERT INTO {deliveries} (event_id, handler, outcome, attempt, recorded_at, reason)
VALUES (%(event_id)s, %(handler)s, %(outcome)s, %(attempt)s, {now}, %(reason)s)

-- name: insert_record_fenced
-- A delivery never opened: its record, autocommitted, fenced by the token.
INSERT INTO {deliveries} (event_id, handler, outcome, attempt, recorded_at, reason)
SELECT id, %(handler)s, %(outcome)s, %(attempt)s, {now}, %(reason)s
  FROM {events}
 WHERE id = %(event_id)s AND token = %(token)s AND published_at IS NULL AND failed_at IS NULL
   FOR UPDATE

-- name: insert_records_fenced
-- A batch's kept records (JSON RECORD_COLUMNS rows), each fenced by its token.
INSERT INTO {deliveries} (event_id, handler, outcome, attempt, recorded_at, reason)
SELECT e.id, r.handler, r.outcome, r.attempt, COALESCE(r.at, UTC_TIMESTAMP(6)), r.reason
  FROM JSON_TABLE(%(items)s, '$[*]' COLUMNS (
         ord FOR ORDINALITY, id BIGINT PATH '$[0]', token VARCHAR(32) PATH '$[1]',
         handler VARCHAR(255) PATH '$[2]', outcome VARCHAR(16) PATH '$[3]',
         attempt INT PATH '$[4]', at DATETIME(6) PATH '$[5]', reason LONGTEXT PATH '$[6]')) AS r
  JOIN {events} AS e ON e.id = r.id AND e.token = r.token
 WHERE e.published_at IS NULL AND e.failed_at IS NULL
 ORDER BY r.ord

-- name: extend
-- R13, fenced by the tokens (each unique to one claim of one event).
SELECT id FROM {events}
 WHERE id IN %(ids)s AND token IN %(tokens)s AND published_at IS NULL AND failed_at IS NULL
   FOR UPDATE;
UPDATE {events} SET locked_until = {now} + INTERVAL %(lease)s MICROSECOND WHERE id IN %(picked)s;
SELECT token, locked_until FROM {events} WHERE id IN %(picked)s

-- name: settle_many
-- R8, each event fenced by its token: %(items)s is JSON SETTLE_COLUMNS rows.
SELECT e.id
  FROM {events} AS e
  JOIN JSON_TABLE(%(items)s, '$[*]' COLUMNS (
         id BIGINT PATH '$[0]', token VARCHAR(32) PATH '$[1]')) AS s
    ON e.id = s.id AND e.token = s.token
 WHERE e.published_at IS NULL AND e.failed_at IS NULL
   FOR UPDATE;
UPDATE {events} AS e
  JOIN JSON_TABLE(%(items)s, '$[*]' COLUMNS (
         id BIGINT PATH '$[0]', publish INT PATH '$[2]', dead INT PATH '$[3]',
         retry_after BIGINT PATH '$[4]', keeps_error INT PATH '$[5]',
         error LONGTEXT PATH '$[6]')) AS s
    ON e.id = s.id
   SET e.published_at = IF(s.publish, {now}, e.published_at),
       e.failed_at = IF(s.dead, {now}, e.failed_at),
       e.available_at = IF(s.retry_after IS NULL, e.available_at,
                           {now} + INTERVAL s.retry_after MICROSECOND),
       e.last_error = IF(s.keeps_error, s.error, e.last_error),
       e.locked_until = NULL,
       e.token = NULL
 WHERE e.id IN %(picked)s

-- name: publish_many
SELECT id FROM {events}
 WHERE id IN %(ids)s AND token IN %(tokens)s AND published_at IS NULL AND failed_at IS NULL
   FOR UPDATE;
UPDATE {events} SET published_at = {now}, locked_until = NULL, token = NULL
 WHERE id IN %(picked)s

-- name: release
SELECT id FROM {events}
 WHERE id IN %(ids)s AND token IN %(tokens)s AND published_at IS NULL AND failed_at IS NULL
   FOR UPDATE;
UPDATE {events} SET locked_until = NULL, token = NULL, attempts = GREATEST(attempts - 1, 0)
 WHERE id IN %(picked)s

-- name: requeue
SELECT id FROM {events} WHERE id IN %(ids)s AND failed_at IS NOT NULL FOR UPDATE;
UPDATE {events}
   SET failed_at = NULL, attempts = 0, available_at = {now}, locked_until = NULL, token = NULL
 WHERE id IN %(picked)s

-- name: get
SELECT {event_columns} FROM {events} WHERE id = %(id)s

-- name: events
SELECT {event_columns} FROM {events}
 WHERE id > %(after_id)s AND (%(topic)s IS NULL OR topic = %(topic)s)
 ORDER BY id
 LIMIT %(limit)s

-- name: dead_letters
SELECT {event_columns} FROM {events}
 WHERE failed_at IS NOT NULL
   AND (%(topic)s IS NULL OR topic = %(topic)s)
   AND (%(since)s IS NULL OR failed_at >= %(since)s)
 ORDER BY failed_at, id
 LIMIT %(limit)s

-- name: records
SELECT event_id, handler, outcome, attempt, recorded_at, reason
  FROM {deliveries} WHERE event_id IN %(ids)s ORDER BY seq

-- name: purge_published
SELECT id FROM {events}
 WHERE published_at IS NOT NULL AND published_at < %(before)s
 ORDER BY published_at LIMIT %(limit)s
   FOR UPDATE;
DELETE FROM {deliveries} WHERE event_id IN %(picked)s;
DELETE FROM {events} WHERE id IN %(picked)s

-- name: purge_dead
-- %(any)s: ids is None (any dead event).
SELECT id FROM {events}
 WHERE failed_at IS NOT NULL AND published_at IS NULL
   AND (%(any)s OR id IN %(ids)s)
   AND (%(before)s IS NULL OR failed_at < %(before)s)
 ORDER BY failed_at, id LIMIT %(limit)s
   FOR UPDATE;
DELETE FROM {deliveries} WHERE event_id IN %(picked)s;
DELETE FROM {events} WHERE id IN %(picked)s

-- name: stats
SELECT topic,
       CASE WHEN published_at IS NOT NULL THEN 'published'
            WHEN failed_at IS NOT NULL THEN 'dead'
            WHEN locked_until IS NOT NULL AND locked_until > {now} THEN 'claimed'
            ELSE 'pending' END AS state,
       COUNT(*),
       MIN(CASE WHEN published_at IS NULL AND failed_at IS NULL
                 AND (locked_until IS NULL OR locked_until <= {now})
                 AND available_at <= {now} THEN available_at END)
  FROM {events}
 GROUP BY topic, state
-- The keys a dead event holds up under dead_key="hold" (fold_stats reads the NULL topic).
 UNION ALL
SELECT NULL, 'held_keys', COUNT(DISTINCT `key`), NULL
  FROM {events}
 WHERE failed_at IS NOT NULL AND `key` IS NOT NULL
