-- The Postgres store's SQL, one named statement per block (loaded by outboxkit._sql.loader; the
-- statements the shared operations run are listed in outboxkit/_sql/base.py, with the same
-- names and parameters as the SQLite store's; outboxkit_pg/names.py fills the identifiers).
--
-- Identifiers are slots: {schema}, {events}, {deliveries}, {versions} (schema-qualified tables),
-- {due_index} and friends (index names) and {channel}; outboxkit_pg fills them with
-- psycopg.sql.Identifier, after validate_identifier. Values are always bound parameters,
-- %(name)s; arrays as %(name)b, in binary (psycopg's text format escapes every element of
-- a text array through a regular expression: milliseconds per hundred). Comment lines
-- (starting with two dashes) are dropped by the loader, so they may say anything.
--
-- Time: every statement that needs "now" takes it as %(now)s and falls back to the database
-- clock, coalesce(%(now)s::timestamptz, now()) (River style): NULL means the server's clock, so
-- pollers on many machines never disagree; a test clock's instant is bound instead.
--
-- Fences: every statement that acts on claimed rows by id (lock_for_delivery, lock_in_batch,
-- the fenced records, extend, settle_many, release) says "not published, not dead" as
-- coalesce(published_at, failed_at) IS NULL, not as the two IS NULL tests of the due index's
-- predicate. With the two tests the planner may prove that partial index usable and walk all
-- of it, (available_at, id), for one id: on a freshly filled table, before autovacuum has
-- analyzed it, it does (0.95 -> 0.71 ms per fenced record at 10,000 due events, measured);
-- written this way only the primary key reaches a row by id.


-- name: clock
-- The database's clock: what every %(now)s falls back to, and what cutoffs are computed from.
SELECT now()

-- name: find_schema
SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %(schema)s

-- name: create_schema
CREATE SCHEMA {schema}

-- name: find_table
SELECT 1
  FROM pg_catalog.pg_class AS c
  JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
 WHERE n.nspname = %(schema)s AND c.relname = %(table)s

-- name: lock_migrations
-- Transaction-scoped: released at COMMIT/ROLLBACK, so a crashed migrator never holds it.
SELECT pg_advisory_xact_lock(%(lock_space)s::integer, %(lock_key)s::integer)

-- name: create_versions
CREATE TABLE {versions} (
    version integer PRIMARY KEY,
    description text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- name: schema_version
-- The version, and whether the events table is partitioned (outboxkit_pg/partitions.py): a
-- store opened for the other layout is refused at its first use.
SELECT coalesce(max(version), 0),
       EXISTS (SELECT FROM pg_catalog.pg_partitioned_table
                WHERE partrelid = to_regclass('{events}'))
  FROM {versions}

-- name: record_version
INSERT INTO {versions} (version, description) VALUES (%(version)s, %(description)s)

-- name: migration_1
-- The events table is a queue: rows are inserted, updated two or three times (claim, maybe
-- extend, settle) and purged later. fillfactor 80 leaves room on each page so the claim,
-- extend and release updates, which touch no indexed column, stay HOT (no index writes, the
-- old version pruned in place). Autovacuum runs at 2 % dead rows instead of 20 %, so the due
-- index the claim walks does not fill up with dead entries.
CREATE TABLE {events} (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic text NOT NULL,
    payload jsonb NOT NULL,
    headers jsonb NOT NULL,
    key text,
    created_at timestamptz NOT NULL,
    available_at timestamptz NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    locked_until timestamptz,
    claim_token uuid,
    published_at timestamptz,
    failed_at timestamptz,
    last_error text
) WITH (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02
);
-- R2/R3: the claim walks this index in (available_at, id) order; it holds only the events
-- that are neither published nor dead, so it stays small however many are kept.
CREATE INDEX {due_index} ON {events} (available_at, id)
    WHERE published_at IS NULL AND failed_at IS NULL;
CREATE INDEX {published_index} ON {events} (published_at) WHERE published_at IS NOT NULL;
CREATE INDEX {dead_index} ON {events} (failed_at, id) WHERE failed_at IS NOT NULL;
CREATE TABLE {deliveries} (
    event_id bigint NOT NULL REFERENCES {events} (id) ON DELETE CASCADE,
    handler text NOT NULL,
    outcome text NOT NULL CHECK (outcome IN ('succeeded', 'rejected')),
    attempt integer NOT NULL,
    recorded_at timestamptz NOT NULL,
    reason text,
    seq bigint GENERATED ALWAYS AS IDENTITY,
    PRIMARY KEY (event_id, handler)
);


-- name: migration_2
-- The commit guard. A transactional handler gets the delivery transaction's connection; a raw
-- COMMIT through it would commit the handler's writes with no delivery record (and the handler
-- would run again). lock_for_delivery marks the transaction as holding an open delivery (the
-- transaction-local setting outboxkit.open_delivery) and touches the event row, which queues
-- this deferred trigger; close_delivery (migration_7) clears the mark. At COMMIT the trigger
-- refuses to commit while a delivery is open, so the handler's COMMIT fails and everything in
-- the transaction is rolled back. A savepoint rolled back takes its mark and its queued trigger
-- with it. The WHEN clause picks the touch (token and lease unchanged) out of every other
-- update of the table.
CREATE FUNCTION {guard_function}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF coalesce(current_setting('outboxkit.open_delivery', true), '') <> '' THEN
        RAISE EXCEPTION 'outboxkit: a handler ended the delivery transaction of event %', NEW.id
            USING DETAIL = 'Only outboxkit commits a delivery transaction, together with its '
                           'delivery record; the transaction was rolled back.',
                  HINT = 'Do not COMMIT or ROLLBACK through ctx.connection.';
    END IF;
    RETURN NULL;
END
$$;
CREATE CONSTRAINT TRIGGER {guard_trigger}
    AFTER UPDATE ON {events}
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (OLD.claim_token IS NOT NULL
          AND NEW.claim_token = OLD.claim_token
          AND NEW.locked_until IS NOT DISTINCT FROM OLD.locked_until)
    EXECUTE FUNCTION {guard_function}();


-- name: migration_3
-- R15, per-key order by commit. A keyed event takes the next number of its key from the key's
-- row in {keys}, with an upsert that locks that row until the enqueuing transaction ends: a
-- second transaction enqueueing the same key waits there for the first to commit (or roll
-- back), so a key's numbers follow the order its transactions commit in, and a claim that sees
-- an event of a key sees every earlier one. Other keys (and unkeyed events) never wait: there
-- is no lock but the key's own. The claim asks key_index whether an earlier event of the key is
-- unpublished (and not dead, unless the key is held). Events enqueued before this version keep
-- their id order. R16: one event per dedupe key until it is purged (a unique partial index; a
-- second inserter waits for the first's transaction, then inserts nothing).
CREATE TABLE {keys} (
    key text PRIMARY KEY,
    last_seq bigint NOT NULL
);
ALTER TABLE {events} ADD COLUMN key_seq bigint, ADD COLUMN dedupe_key text;
UPDATE {events} SET key_seq = id WHERE key IS NOT NULL;
INSERT INTO {keys} (key, last_seq)
SELECT key, max(id) FROM {events} WHERE key IS NOT NULL GROUP BY key;
CREATE INDEX {key_index} ON {events} (key, key_seq)
    WHERE key IS NOT NULL AND published_at IS NULL;
CREATE UNIQUE INDEX {dedupe_index} ON {events} (dedupe_key) WHERE dedupe_key IS NOT NULL;


-- name: migration_4
-- The claim's fast shape. The delivery records lose their foreign key: every record is written
-- fenced by its event's row (insert_record_fenced and insert_records_fenced lock it, insert_record
-- runs after lock_for_delivery, settle_many_recording after the settlement's update), so no
-- record can point at a missing event, and the purges delete an event's records with it; the
-- key's check cost each record a trigger and a row lock (3-4 us per event in a batch, measured).
-- has_history: set when an event's attempts stop counting its earlier claims (requeue resets
-- them, release refunds one), so the claim reads the records of an event only when an earlier
-- claim may have left some (attempts above 1, or has_history), instead of probing the records
-- of every event it claims.
DO $$
DECLARE
    fk name;
BEGIN
    FOR fk IN
        SELECT conname FROM pg_catalog.pg_constraint
         WHERE conrelid = '{deliveries}'::regclass AND contype = 'f'
    LOOP
        EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', '{deliveries}'::regclass, fk);
    END LOOP;
END
$$;
ALTER TABLE {events} ADD COLUMN has_history boolean NOT NULL DEFAULT false;
UPDATE {events} SET has_history = true
 WHERE published_at IS NULL
   AND EXISTS (SELECT 1 FROM {deliveries} AS r WHERE r.event_id = {events}.id);


-- name: migration_5
-- The message identity: a random uuid per event, drawn by the column's default when the event
-- is inserted (every enqueue statement leaves the column to it), read back with the event and
-- sent by the relays as the message's id (the inbox's key). Event ids are unique in one
-- database only; this is unique across databases, a cloned one included. The column is added
-- first and given its default after, so the rows already there keep NULL (no rewrite of the
-- table): their identity stays their decimal id, which their messages carried before.
ALTER TABLE {events} ADD COLUMN message_id uuid;
ALTER TABLE {events} ALTER COLUMN message_id SET DEFAULT gen_random_uuid();


-- name: migration_6
-- The error of each failed attempt (capabilities.error_history): settle_many and
-- settle_many_recording append [attempt, at, error] to this array when they keep an error (a
-- retry or a dead letter), in the same UPDATE that writes last_error; attempt_errors reads it.
-- Added without a default: no rewrite of the table, and NULL (no failure yet) costs nothing.
ALTER TABLE {events} ADD COLUMN errors jsonb;


-- name: migration_7
-- The close of a delivery transaction in one statement (close_delivery): R17's check that the
-- transaction is still the one lock_for_delivery or lock_in_batch opened, the record, and with
-- the delivery's last record R18's reset of the session's settings and the store's UTC zone.
-- Four statements of each delivery's last sync become one: measured with a handler that writes
-- a row (bench/pg_delivery_cost.py), the server's CPU per delivery went from 1.81-1.90x the
-- hand-written loop's to 1.68-1.71x.
CREATE FUNCTION {close_function}(
    event_id bigint, handler text, outcome text, attempt integer, recorded_at timestamptz,
    reason text, last boolean, utc boolean
) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('outboxkit.open_delivery', true) IS DISTINCT FROM event_id::text THEN
        RAISE EXCEPTION 'outboxkit: the delivery transaction of event % was ended under its '
                        'handler', event_id
            USING ERRCODE = 'OBX17',
                  DETAIL = 'The transaction is not the one outboxkit opened for the delivery: '
                           'the handler rolled it back, or ended it and began another.';
    END IF;
    INSERT INTO {deliveries} (event_id, handler, outcome, attempt, recorded_at, reason)
    VALUES (event_id, handler, outcome, attempt, coalesce(recorded_at, now()), reason);
    IF last THEN
        RESET ALL;
        IF utc THEN
            SET TimeZone = 'UTC';
        END IF;
    END IF;
END
$$;


-- name: enqueue
-- R1: one statement for the whole batch, through the caller's connection. The batch comes as
-- one JSON document, an array of [topic, payload, headers, key, delay in microseconds] per
-- event (one text parameter: psycopg adapts a list parameter element by element in Python,
-- which cost more than PostgreSQL parsing the document). Ids follow the batch order. The
-- notification (no event data in it) is queued by the same statement and delivered by
-- PostgreSQL only when the caller commits; the scalar subquery runs once per statement.
-- Each element also carries a dedupe key and an absolute due instant (or nulls). R15: the keys
-- CTE takes each key's numbers (locking its row, in key order so that two batches never
-- deadlock); R16: an event whose dedupe key is taken is not inserted, and comes back with no
-- row (the store looks its holder up in a statement of its own: see dedupe_holders).
WITH n AS MATERIALIZED (
    SELECT x.e ->> 0 AS topic, x.e -> 1 AS payload, x.e -> 2 AS headers, x.e ->> 3 AS key,
           (x.e ->> 4)::bigint AS delay_us, x.e ->> 5 AS dedupe_key,
           (x.e ->> 6)::timestamptz AS available_at, x.position,
           row_number() OVER (PARTITION BY x.e ->> 3 ORDER BY x.position) AS nth,
           count(*) OVER (PARTITION BY x.e ->> 3) AS of_key
      FROM jsonb_array_elements(%(events)s::jsonb) WITH ORDINALITY AS x (e, position)
), k AS (
    INSERT INTO {keys} AS k (key, last_seq)
    SELECT key, max(of_key) FROM n WHERE key IS NOT NULL GROUP BY key ORDER BY key
    ON CONFLICT (key) DO UPDATE SET last_seq = k.last_seq + excluded.last_seq
    RETURNING k.key, k.last_seq
)
INSERT INTO {events} (topic, payload, headers, key, key_seq, dedupe_key, created_at,
                      available_at)
SELECT n.topic, n.payload, n.headers, n.key, k.last_seq - n.of_key + n.nth, n.dedupe_key,
       coalesce(%(now)s::timestamptz, now()),
       coalesce(n.available_at,
                coalesce(%(now)s::timestamptz, now()) + n.delay_us * interval '1 microsecond')
  FROM n LEFT JOIN k ON k.key = n.key
 ORDER BY n.position
ON CONFLICT (dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING
RETURNING id, dedupe_key, (SELECT pg_notify(%(channel)s, '') WHERE %(notify)s::boolean)

-- name: enqueue_keyed
-- `enqueue` on the partitioned layout (outboxkit_pg/partitions.py), whose events table has no
-- dedupe index (a unique index of a partitioned table must hold its partition key, the id):
-- the keys numbered as there; dedupe keys are refused before (capabilities.dedupe is false).
WITH n AS MATERIALIZED (
    SELECT x.e ->> 0 AS topic, x.e -> 1 AS payload, x.e -> 2 AS headers, x.e ->> 3 AS key,
           (x.e ->> 4)::bigint AS delay_us, (x.e ->> 6)::timestamptz AS available_at,
           x.position,
           row_number() OVER (PARTITION BY x.e ->> 3 ORDER BY x.position) AS nth,
           count(*) OVER (PARTITION BY x.e ->> 3) AS of_key
      FROM jsonb_array_elements(%(events)s::jsonb) WITH ORDINALITY AS x (e, position)
), k AS (
    INSERT INTO {keys} AS k (key, last_seq)
    SELECT key, max(of_key) FROM n WHERE key IS NOT NULL GROUP BY key ORDER BY key
    ON CONFLICT (key) DO UPDATE SET last_seq = k.last_seq + excluded.last_seq
    RETURNING k.key, k.last_seq
)
INSERT INTO {events} (topic, payload, headers, key, key_seq, created_at, available_at)
SELECT n.topic, n.payload, n.headers, n.key, k.last_seq - n.of_key + n.nth,
       coalesce(%(now)s::timestamptz, now()),
       coalesce(n.available_at,
                coalesce(%(now)s::timestamptz, now()) + n.delay_us * interval '1 microsecond')
  FROM n LEFT JOIN k ON k.key = n.key
 ORDER BY n.position
RETURNING id, NULL::text, (SELECT pg_notify(%(channel)s, '') WHERE %(notify)s::boolean)

-- name: enqueue_plain
-- `enqueue` for a batch in which no event has a key or a dedupe key (the usual batch): the same
-- rows, ids in batch order and notification, without numbering keys or the dedupe arbiter (the
-- keys CTE's window functions sort the batch; with them a 100-event batch cost 3.5 us more per
-- event on the server, measured). The second column stands for `enqueue`'s dedupe key.
INSERT INTO {events} (topic, payload, headers, created_at, available_at)
SELECT x.e ->> 0, x.e -> 1, x.e -> 2,
       coalesce(%(now)s::timestamptz, now()),
       coalesce((x.e ->> 6)::timestamptz,
                coalesce(%(now)s::timestamptz, now()) + (x.e ->> 4)::bigint * interval '1 microsecond')
  FROM jsonb_array_elements(%(events)s::jsonb) WITH ORDINALITY AS x (e, position)
 ORDER BY x.position
RETURNING id, NULL::text, (SELECT pg_notify(%(channel)s, '') WHERE %(notify)s::boolean)

-- name: dedupe_holders
-- R16: the stored events holding the given dedupe keys.
SELECT dedupe_key, id FROM {events} WHERE dedupe_key = ANY(%(keys)s::text[])

-- name: enqueue_portable
-- `enqueue` through a connection another library drives (SQLAlchemy's, on psycopg 3, psycopg2 or
-- asyncpg): the same rows and notification, with named parameters (:name) and casts spelt
-- CAST(... AS ...), and the notification's void result counted, so that every driver reads it.
-- The keys are numbered as in `enqueue`; dedupe keys are refused before (portable_enqueue).
WITH n AS MATERIALIZED (
    SELECT x.e ->> 0 AS topic, x.e -> 1 AS payload, x.e -> 2 AS headers, x.e ->> 3 AS key,
           CAST(x.e ->> 4 AS bigint) AS delay_us,
           CAST(x.e ->> 6 AS timestamptz) AS available_at, x.position,
           row_number() OVER (PARTITION BY x.e ->> 3 ORDER BY x.position) AS nth,
           count(*) OVER (PARTITION BY x.e ->> 3) AS of_key
      FROM jsonb_array_elements(CAST(:events AS jsonb)) WITH ORDINALITY AS x (e, position)
), k AS (
    INSERT INTO {keys} AS k (key, last_seq)
    SELECT key, max(of_key) FROM n WHERE key IS NOT NULL GROUP BY key ORDER BY key
    ON CONFLICT (key) DO UPDATE SET last_seq = k.last_seq + excluded.last_seq
    RETURNING k.key, k.last_seq
)
INSERT INTO {events} (topic, payload, headers, key, key_seq, created_at, available_at)
SELECT n.topic, n.payload, n.headers, n.key, k.last_seq - n.of_key + n.nth,
       coalesce(CAST(:now AS timestamptz), now()),
       coalesce(n.available_at,
                coalesce(CAST(:now AS timestamptz), now()) + n.delay_us * interval '1 microsecond')
  FROM n LEFT JOIN k ON k.key = n.key
 ORDER BY n.position
RETURNING id,
          (SELECT count(*) FROM (SELECT pg_notify(:channel, '') WHERE CAST(:notify AS boolean)) AS n)

-- name: enqueue_portable_plain
-- `enqueue_portable` for a batch without keys (see enqueue_plain).
INSERT INTO {events} (topic, payload, headers, created_at, available_at)
SELECT x.e ->> 0, x.e -> 1, x.e -> 2,
       coalesce(CAST(:now AS timestamptz), now()),
       coalesce(CAST(x.e ->> 6 AS timestamptz),
                coalesce(CAST(:now AS timestamptz), now())
                + CAST(x.e ->> 4 AS bigint) * interval '1 microsecond')
  FROM jsonb_array_elements(CAST(:events AS jsonb)) WITH ORDINALITY AS x (e, position)
 ORDER BY x.position
RETURNING id,
          (SELECT count(*) FROM (SELECT pg_notify(:channel, '') WHERE CAST(:notify AS boolean)) AS n)

-- name: enqueue_one
-- R1 for a single event (Outbox.enqueue) with neither key nor dedupe key: the same row and
-- notification as `enqueue`, as a plain VALUES insert; the unnest plan costs a fifth of a
-- millisecond more on every call.
INSERT INTO {events} (topic, payload, headers, created_at, available_at)
VALUES (%(topic)s, %(payload)s::jsonb, %(headers)s::jsonb,
        coalesce(%(now)s::timestamptz, now()),
        coalesce(%(available_at)s::timestamptz,
                 coalesce(%(now)s::timestamptz, now()) + %(delay)s::interval))
RETURNING id, (SELECT pg_notify(%(channel)s, '') WHERE %(notify)s::boolean)

-- name: claim
-- R3: one statement. The MATERIALIZED CTE picks and locks at most batch_size due rows, oldest
-- first, skipping rows another claimer or a delivery transaction holds; the LIMIT applies
-- there, so the UPDATE can never touch more rows than the batch. The subselect brings back
-- the handlers already recorded, so Claim.done needs no second round trip; it runs only for an
-- event an earlier claim may have left records of (see migration_4), so a first claim reads
-- none (NULL). R15: a keyed event
-- only while it is its key's head, the lowest key_seq (its commit order, see migration_3) of
-- the key's events that are unpublished and not dead (with %(hold)s: unpublished), so a claim
-- holds at most one event of a key. The head is a LATERAL subquery on the key alone (one probe
-- of key_index), not a NOT EXISTS on (key, key_seq): the planner can then memoize it per key,
-- and the events waiting behind a head cost a cache hit each instead of a probe (a key's
-- waiting events are often neighbours in due order: 100,000 due events in 10,000 keys of 10
-- consecutive ones, 891 of the 991 rows walked for a batch of 100 were hits, measured). A
-- LATERAL with a LIMIT can only run as a parameterized nested loop, so the plan never turns
-- into a join over the whole table. A keyed event without key_seq keeps its old rule (never
-- blocked). The UPDATE finds the picked rows by their primary key (id = ANY of the CTE's ids,
-- one index probe each), not by joining the CTE: the planner sizes a parameterized LIMIT at a
-- third of the table, and a join then hashes the CTE against a scan of the whole table, which
-- it keeps doing until the table holds some tens of thousands of rows (a prepared claim of 100
-- out of 10,000 rows: 2.64 ms with the join, 0.91 ms with the probes; the same 0.9 ms both
-- ways from 50,000 rows on, measured).
WITH due AS MATERIALIZED (
    SELECT e.id
      FROM {events} AS e
      LEFT JOIN LATERAL (
             SELECT b.key_seq AS head
               FROM {events} AS b
              WHERE b.key = e.key
                AND b.published_at IS NULL
                AND (b.failed_at IS NULL OR %(hold)s::boolean)
              ORDER BY b.key_seq
              LIMIT 1) AS h ON e.key IS NOT NULL
     WHERE e.published_at IS NULL
       AND e.failed_at IS NULL
       AND e.available_at <= coalesce(%(now)s::timestamptz, now())
       AND (e.locked_until IS NULL OR e.locked_until <= coalesce(%(now)s::timestamptz, now()))
       AND (e.key IS NULL OR e.key_seq IS NULL OR e.key_seq <= h.head)
     ORDER BY e.available_at, e.id
     LIMIT %(batch_size)s
       FOR UPDATE OF e SKIP LOCKED
)
UPDATE {events} AS e
   SET locked_until = coalesce(%(now)s::timestamptz, now()) + %(lease)s::interval,
       attempts = e.attempts + 1,
       claim_token = gen_random_uuid()
 WHERE e.id = ANY(ARRAY(SELECT id FROM due))
RETURNING e.id, e.topic, e.payload::text, e.headers::text, e.key, e.created_at,
          e.available_at, e.attempts, e.published_at, e.failed_at, e.locked_until, e.last_error,
          e.message_id::text, e.claim_token::text,
          CASE WHEN e.attempts > 1 OR e.has_history
               THEN ARRAY(SELECT ARRAY[r.handler, r.outcome]
                            FROM {deliveries} AS r
                           WHERE r.event_id = e.id
                           ORDER BY r.seq)
          END AS done

-- name: lock_for_delivery
-- R6: the delivery transaction's first statement. Blocks while another transaction holds the
-- row, then re-checks the token on the row's newest version. The no-op update locks the row as
-- FOR UPDATE would and queues the commit guard's trigger (see migration_2); with %(mark)s it
-- also marks the delivery open. A batch (transaction="per_batch") sends it once without the
-- mark, outside its first delivery's savepoint, so that the trigger survives any savepoint
-- rolled back and fires once, at the batch's commit; until it matches a row (a stale first
-- claim matches none), the batch's next delivery sends it again. Each delivery of a batch
-- then locks and marks its row inside its own savepoint with lock_in_batch.
UPDATE {events}
   SET claim_token = claim_token
 WHERE id = %(id)s
   AND claim_token = %(token)s::uuid
   AND coalesce(published_at, failed_at) IS NULL
RETURNING id,
          CASE WHEN %(mark)s::boolean
               THEN set_config('outboxkit.open_delivery', id::text, true) END

-- name: lock_in_batch
-- R6 for a delivery in a batch, inside its savepoint: the row lock and the token check of
-- lock_for_delivery, and the open-delivery mark, without a new row version (the batch queued
-- the guard's trigger once, with lock_for_delivery).
SELECT id, set_config('outboxkit.open_delivery', id::text, true)
  FROM {events}
 WHERE id = %(id)s
   AND claim_token = %(token)s::uuid
   AND coalesce(published_at, failed_at) IS NULL
   FOR UPDATE

-- name: close_delivery
-- A record of a delivery transaction (Flow.closing, prepared, behind a savepoint), through
-- migration_7's function. R17: a record is written only in the transaction (or savepoint) that
-- lock_for_delivery or lock_in_batch opened: their open-delivery mark is transaction-local, so
-- a handler that rolled that transaction back (whole, or to a point before the lock) and wrote
-- again in a new one finds it gone, and the function raises SQLSTATE OBX17 (which the store
-- reports as the handler's failure; nothing of the delivery commits). With the delivery's last
-- record (%(last)s) it resets the session's settings (R18, RESET ALL, which also closes the
-- delivery for the commit guard, see migration_2) and, for the store's own sessions
-- (%(utc)s), sets the zone back to UTC.
SELECT {close_function}(%(event_id)s, %(handler)s, %(outcome)s, %(attempt)s,
                        %(now)s::timestamptz, %(reason)s, %(last)s, %(utc)s)

-- name: insert_record_fenced
-- A delivery whose handler never used its connection (a non-transactional handler, a rejection,
-- a transactional handler that wrote nothing through ctx.connection) is this one statement:
-- the token check, the row lock and the record at once, autocommitted. A stale token inserts
-- nothing (no row returned); the row lock keeps another poller's claim off the row until the
-- record is committed, as lock_for_delivery does for a longer delivery.
INSERT INTO {deliveries} (event_id, handler, outcome, attempt, recorded_at, reason)
SELECT e.id, %(handler)s, %(outcome)s, %(attempt)s, coalesce(%(now)s::timestamptz, now()),
       %(reason)s
  FROM {events} AS e
 WHERE e.id = %(event_id)s
   AND e.claim_token = %(token)s::uuid
   AND coalesce(e.published_at, e.failed_at) IS NULL
   FOR UPDATE
RETURNING event_id

-- name: insert_records_fenced
-- The records a batch's deliveries kept (deliveries whose handler never used the connection,
-- see insert_record_fenced), written together before the batch settles: each inserted only if
-- its event's token still holds, the rows locked until the batch commits; in delivery order.
INSERT INTO {deliveries} (event_id, handler, outcome, attempt, recorded_at, reason)
SELECT e.id, r.handler, r.outcome, r.attempt, coalesce(r.at, now()), r.reason
  FROM unnest(%(ids)b::bigint[], %(tokens)b::uuid[], %(handlers)b::text[],
              %(outcomes)b::text[], %(attempts)b::integer[], %(ats)s::timestamptz[],
              %(reasons)b::text[])
       WITH ORDINALITY AS r (id, token, handler, outcome, attempt, at, reason, ord)
  JOIN {events} AS e ON e.id = r.id AND e.claim_token = r.token
 WHERE coalesce(e.published_at, e.failed_at) IS NULL
 ORDER BY r.ord
   FOR UPDATE OF e
RETURNING event_id

-- name: extend
-- R13: every claim of the batch in one statement, fenced by its token.
UPDATE {events} AS e
   SET locked_until = coalesce(%(now)s::timestamptz, now()) + %(lease)s::interval
  FROM unnest(%(ids)b::bigint[], %(tokens)b::uuid[]) AS c (id, token)
 WHERE e.id = c.id
   AND e.claim_token = c.token
   AND coalesce(e.published_at, e.failed_at) IS NULL
RETURNING e.claim_token::text, e.locked_until

-- name: settle_many
-- R8 for a round's events in one statement, each fenced by its token; one array element per
-- event of each of SETTLE_COLUMNS (outboxkit._sql.rows.settle_row). Returns the ids settled.
-- The rows are reached by joining the unnest to the primary key (a probe per element), with no
-- id = ANY(...) beside it: with one the planner scans the key for the whole array and then
-- compares every row with every element (500 events: 43 ms against 2.7 ms for the probes,
-- measured on 210,000 analyzed rows; worse once the statement is prepared). So do extend,
-- release, insert_records_fenced and settle_many_recording.
UPDATE {events} AS e
   SET published_at = CASE WHEN s.publish
                           THEN coalesce(%(now)s::timestamptz, now()) ELSE e.published_at END,
       failed_at = CASE WHEN s.dead
                        THEN coalesce(%(now)s::timestamptz, now()) ELSE e.failed_at END,
       available_at = CASE WHEN s.retry_after IS NULL THEN e.available_at
                           ELSE coalesce(%(now)s::timestamptz, now()) + s.retry_after
                      END,
       last_error = CASE WHEN s.keeps_error THEN s.error ELSE e.last_error END,
       errors = CASE WHEN s.keeps_error AND s.error IS NOT NULL
                     THEN coalesce(e.errors, '[]'::jsonb)
                          || jsonb_build_array(jsonb_build_array(
                                 e.attempts, coalesce(%(now)s::timestamptz, now()), s.error))
                     ELSE e.errors END,
       locked_until = NULL,
       claim_token = NULL
  FROM unnest(%(ids)b::bigint[], %(tokens)b::uuid[], %(publish)b::boolean[],
              %(dead)b::boolean[], %(retry_after)b::interval[], %(keeps_error)b::boolean[],
              %(errors)b::text[])
       AS s (id, token, publish, dead, retry_after, keeps_error, error)
 WHERE e.id = s.id
   AND e.claim_token = s.token
   AND coalesce(e.published_at, e.failed_at) IS NULL
RETURNING e.id

-- name: settle_many_recording
-- A batch's settle_many and its kept records (insert_records_fenced) in one statement: the
-- UPDATE settles each event fenced by its token and locks its row; the INSERT writes the kept
-- records of the events it settled, in delivery order. The fence of the records is the
-- settlement's own (a stale token settles nothing and records nothing), so the rows are
-- locked and checked once instead of twice. Returns the ids settled, as settle_many.
WITH settled AS (
    UPDATE {events} AS e
       SET published_at = CASE WHEN s.publish
                               THEN coalesce(%(now)s::timestamptz, now()) ELSE e.published_at END,
           failed_at = CASE WHEN s.dead
                            THEN coalesce(%(now)s::timestamptz, now()) ELSE e.failed_at END,
           available_at = CASE WHEN s.retry_after IS NULL THEN e.available_at
                               ELSE coalesce(%(now)s::timestamptz, now()) + s.retry_after
                          END,
           last_error = CASE WHEN s.keeps_error THEN s.error ELSE e.last_error END,
           errors = CASE WHEN s.keeps_error AND s.error IS NOT NULL
                         THEN coalesce(e.errors, '[]'::jsonb)
                              || jsonb_build_array(jsonb_build_array(
                                     e.attempts, coalesce(%(now)s::timestamptz, now()), s.error))
                         ELSE e.errors END,
           locked_until = NULL,
           claim_token = NULL
      FROM unnest(%(ids)b::bigint[], %(tokens)b::uuid[], %(publish)b::boolean[],
                  %(dead)b::boolean[], %(retry_after)b::interval[], %(keeps_error)b::boolean[],
                  %(errors)b::text[])
           AS s (id, token, publish, dead, retry_after, keeps_error, error)
     WHERE e.id = s.id
       AND e.claim_token = s.token
       AND coalesce(e.published_at, e.failed_at) IS NULL
    RETURNING e.id
), recorded AS (
    INSERT INTO {deliveries} (event_id, handler, outcome, attempt, recorded_at, reason)
    SELECT r.id, r.handler, r.outcome, r.attempt, coalesce(r.at, now()), r.reason
      FROM unnest(%(record_ids)b::bigint[], %(handlers)b::text[], %(outcomes)b::text[],
                  %(attempts)b::integer[], %(ats)s::timestamptz[], %(reasons)b::text[])
           WITH ORDINALITY AS r (id, handler, outcome, attempt, at, reason, ord)
      JOIN settled AS s ON s.id = r.id
     ORDER BY r.ord
)
SELECT id FROM settled

-- name: publish_many
-- settle_many when every event of the round is published (the usual round): the ids and the
-- tokens alone, so the statement binds two arrays instead of seven and sets no CASE.
UPDATE {events} AS e
   SET published_at = coalesce(%(now)s::timestamptz, now()),
       locked_until = NULL,
       claim_token = NULL
  FROM unnest(%(ids)b::bigint[], %(tokens)b::uuid[]) AS s (id, token)
 WHERE e.id = s.id
   AND e.claim_token = s.token
   AND coalesce(e.published_at, e.failed_at) IS NULL
RETURNING e.id

-- name: publish_recording
-- settle_many_recording when every event is published and every kept record is a success
-- stamped with the settlement's own instant (the usual batch): the records' attempt is their
-- event's, read from the row the settlement locks (the token fences it: the claim's attempt).
WITH settled AS (
    UPDATE {events} AS e
       SET published_at = coalesce(%(now)s::timestamptz, now()),
           locked_until = NULL,
           claim_token = NULL
      FROM unnest(%(ids)b::bigint[], %(tokens)b::uuid[]) AS s (id, token)
     WHERE e.id = s.id
       AND e.claim_token = s.token
       AND coalesce(e.published_at, e.failed_at) IS NULL
    RETURNING e.id, e.attempts
), recorded AS (
    INSERT INTO {deliveries} (event_id, handler, outcome, attempt, recorded_at, reason)
    SELECT r.id, r.handler, 'succeeded', s.attempts, coalesce(%(now)s::timestamptz, now()), NULL
      FROM unnest(%(record_ids)b::bigint[], %(handlers)b::text[])
           WITH ORDINALITY AS r (id, handler, ord)
      JOIN settled AS s ON s.id = r.id
     ORDER BY r.ord
)
SELECT id FROM settled

-- name: release
-- Unstarted claims handed back: lease cleared and the attempt refunded, fenced by token.
UPDATE {events} AS e
   SET locked_until = NULL,
       claim_token = NULL,
       attempts = greatest(e.attempts - 1, 0),
       has_history = true
  FROM unnest(%(ids)b::bigint[], %(tokens)b::uuid[]) AS c (id, token)
 WHERE e.id = c.id
   AND e.claim_token = c.token
   AND coalesce(e.published_at, e.failed_at) IS NULL
RETURNING e.id

-- name: requeue
-- R12: dead events due again with attempts reset; their delivery records stay.
UPDATE {events}
   SET failed_at = NULL,
       attempts = 0,
       has_history = true,
       available_at = coalesce(%(now)s::timestamptz, now()),
       locked_until = NULL,
       claim_token = NULL
 WHERE id = ANY(%(ids)b::bigint[])
   AND failed_at IS NOT NULL
RETURNING id

-- name: attempt_errors
-- The error of each failed attempt of one event, oldest first (see migration_6).
SELECT (x.a ->> 0)::integer, (x.a ->> 1)::timestamptz, x.a ->> 2
  FROM {events} AS e, jsonb_array_elements(e.errors) WITH ORDINALITY AS x (a, n)
 WHERE e.id = %(id)s
 ORDER BY x.n

-- name: get
SELECT id, topic, payload::text, headers::text, key, created_at, available_at, attempts,
       published_at, failed_at, locked_until, last_error, message_id::text
  FROM {events}
 WHERE id = %(id)s

-- name: events
SELECT id, topic, payload::text, headers::text, key, created_at, available_at, attempts,
       published_at, failed_at, locked_until, last_error, message_id::text
  FROM {events}
 WHERE id > %(after_id)s
   AND (%(topic)s::text IS NULL OR topic = %(topic)s::text)
 ORDER BY id
 LIMIT %(limit)s

-- name: dead_letters
SELECT id, topic, payload::text, headers::text, key, created_at, available_at, attempts,
       published_at, failed_at, locked_until, last_error, message_id::text
  FROM {events}
 WHERE failed_at IS NOT NULL
   AND (%(topic)s::text IS NULL OR topic = %(topic)s::text)
   -- A bound the index can seek to, even in a generic plan (see the SQLite store's query).
   AND failed_at >= coalesce(%(since)s::timestamptz, '-infinity'::timestamptz)
 ORDER BY failed_at, id
 LIMIT %(limit)s

-- name: records
SELECT event_id, handler, outcome, attempt, recorded_at, reason
  FROM {deliveries}
 WHERE event_id = ANY(%(ids)b::bigint[])
 ORDER BY seq

-- name: purge_published
-- One page; the delivery records go with their events, in the same statement (see
-- migration_4). The conditions are repeated on the outer DELETE: the subquery picks rows from
-- its snapshot, and only the outer conditions are checked again on the newest version of a row
-- another transaction changed meanwhile (READ COMMITTED), so a row that stopped qualifying is
-- left alone. No record can be added to a purged event: every record is written fenced by its
-- event's row, which a published or dead event no longer passes.
WITH gone AS (
    DELETE FROM {events}
     WHERE id IN (SELECT id
                    FROM {events}
                   WHERE published_at < %(before)s::timestamptz
                   ORDER BY published_at
                   LIMIT %(limit)s)
       AND published_at < %(before)s::timestamptz
    RETURNING id
), records AS (
    DELETE FROM {deliveries} AS r USING gone WHERE r.event_id = gone.id
)
SELECT id FROM gone

-- name: purge_dead
-- As purge_published (the records go along): the outer conditions make a requeue that commits
-- first win (its row is no longer dead when the DELETE gets to it), so a requeue and a purge of
-- one dead letter never both act on it.
WITH gone AS (
    DELETE FROM {events}
     WHERE id IN (SELECT id
                    FROM {events}
                   WHERE failed_at IS NOT NULL
                     AND (%(ids)b::bigint[] IS NULL OR id = ANY(%(ids)b::bigint[]))
                     AND (%(before)s::timestamptz IS NULL OR failed_at < %(before)s::timestamptz)
                   ORDER BY failed_at, id
                   LIMIT %(limit)s)
       AND failed_at IS NOT NULL
       AND published_at IS NULL
       AND (%(before)s::timestamptz IS NULL OR failed_at < %(before)s::timestamptz)
    RETURNING id
), records AS (
    DELETE FROM {deliveries} AS r USING gone WHERE r.event_id = gone.id
)
SELECT id FROM gone

-- name: stats
SELECT topic, state, count(*), min(available_at) FILTER (WHERE due)
  FROM (SELECT topic,
               available_at,
               CASE WHEN published_at IS NOT NULL THEN 'published'
                    WHEN failed_at IS NOT NULL THEN 'dead'
                    WHEN locked_until > coalesce(%(now)s::timestamptz, now()) THEN 'claimed'
                    ELSE 'pending'
               END AS state,
               published_at IS NULL AND failed_at IS NULL
                 AND available_at <= coalesce(%(now)s::timestamptz, now())
                 AND (locked_until IS NULL
                      OR locked_until <= coalesce(%(now)s::timestamptz, now())) AS due
          FROM {events}) AS e
 GROUP BY topic, state
-- The keys a dead event holds up under dead_key="hold" (fold_stats reads the NULL topic).
 UNION ALL
SELECT NULL, 'held_keys', count(DISTINCT key), NULL
  FROM {events}
 WHERE failed_at IS NOT NULL AND key IS NOT NULL

-- name: listen
LISTEN {channel}

-- name: drop_schema
DROP SCHEMA {schema} CASCADE
