-- The partitioned layout's SQL (outboxkit_pg/partitions.py), loaded like queries.sql. Besides
-- queries.sql's slots, {partition} and {records_partition} (a partition of the events table and
-- of the delivery records, schema-qualified), {partition_name} and friends (the same names
-- unqualified, for RENAME TO), {events_seq} and {records_seq} (the sequences that number the
-- events and the records) and {lower}/{upper} (a partition's bounds, integer literals) are
-- filled with psycopg.sql.Identifier and psycopg.sql.Literal; values stay bound parameters.
--
-- Both tables are partitioned by event id, in ranges of the store's partition_size, with the
-- same bounds: an event and its records are in partitions of the same range, dropped together.
-- Ids are handed out in time order, so a range is a stretch of time: a partition whose every
-- event was published before the retention's cutoff is dropped whole (no row deleted, no dead
-- tuple left for vacuum), where the other layout deletes its rows one page at a time.


-- name: layout_ids
-- The highest id in either table (the first partition's range ends above it).
SELECT greatest((SELECT coalesce(max(id), 0) FROM {events}),
                (SELECT coalesce(max(event_id), 0) FROM {deliveries}))

-- name: convert
-- Today's tables become the first partitions of partitioned tables of the same names, in one
-- transaction under the migration lock (and an exclusive lock on both tables: writers wait for
-- it, a few milliseconds whatever the size, as nothing is copied or rewritten). The identity
-- columns become sequences that go on from where they were (a partitioned table has no
-- identity column before PostgreSQL 17). The old indexes are renamed after their partition,
-- and the partitioned indexes created after the ATTACH adopt them (no index is rebuilt). The
-- dedupe index goes: a unique index of a partitioned table must include its partition key,
-- so this layout has no dedupe keys (capabilities.dedupe is false). The guard trigger moves to
-- the partitioned table, which gives every partition its clone.
LOCK TABLE {events}, {deliveries} IN ACCESS EXCLUSIVE MODE;
ALTER TABLE {events} RENAME TO {partition_name};
ALTER INDEX {events_pkey} RENAME TO {partition_pkey};
ALTER INDEX {due_index_q} RENAME TO {partition_due};
ALTER INDEX {published_index_q} RENAME TO {partition_published};
ALTER INDEX {dead_index_q} RENAME TO {partition_dead};
ALTER INDEX {key_order_index_q} RENAME TO {partition_key_order};
DROP INDEX {dedupe_index_q};
DROP TRIGGER {guard_trigger} ON {partition};
ALTER TABLE {partition} ALTER COLUMN id DROP IDENTITY;
CREATE SEQUENCE {events_seq} AS bigint START WITH {upper_start};
CREATE TABLE {events} (LIKE {partition} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY RANGE (id);
ALTER TABLE {events} ALTER COLUMN id SET DEFAULT nextval('{events_seq}');
ALTER SEQUENCE {events_seq} OWNED BY {events}.id;
ALTER TABLE {events} ADD PRIMARY KEY (id);
ALTER TABLE {events} ATTACH PARTITION {partition} FOR VALUES FROM (MINVALUE) TO ({upper});
CREATE INDEX {due_index} ON {events} (available_at, id)
    WHERE published_at IS NULL AND failed_at IS NULL;
CREATE INDEX {published_index} ON {events} (published_at) WHERE published_at IS NOT NULL;
CREATE INDEX {dead_index} ON {events} (failed_at, id) WHERE failed_at IS NOT NULL;
CREATE INDEX {key_index} ON {events} (key, key_seq)
    WHERE key IS NOT NULL AND published_at IS NULL;
CREATE CONSTRAINT TRIGGER {guard_trigger}
    AFTER UPDATE ON {events}
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (OLD.claim_token IS NOT NULL
          AND NEW.claim_token = OLD.claim_token
          AND NEW.locked_until IS NOT DISTINCT FROM OLD.locked_until)
    EXECUTE FUNCTION {guard_function}();
ALTER TABLE {deliveries} RENAME TO {records_partition_name};
ALTER INDEX {deliveries_pkey} RENAME TO {records_partition_pkey};
ALTER TABLE {records_partition} ALTER COLUMN seq DROP IDENTITY;
CREATE SEQUENCE {records_seq} AS bigint START WITH {records_start};
CREATE TABLE {deliveries} (LIKE {records_partition} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY RANGE (event_id);
ALTER TABLE {deliveries} ALTER COLUMN seq SET DEFAULT nextval('{records_seq}');
ALTER TABLE {deliveries} ALTER COLUMN seq SET NOT NULL;
ALTER SEQUENCE {records_seq} OWNED BY {deliveries}.seq;
ALTER TABLE {deliveries} ADD PRIMARY KEY (event_id, handler);
ALTER TABLE {deliveries} ATTACH PARTITION {records_partition}
    FOR VALUES FROM (MINVALUE) TO ({upper})

-- name: records_start
SELECT coalesce(max(seq), 0) + 1 FROM {deliveries}

-- name: partitions
-- The partitions of the events table: name, bound (as PostgreSQL prints it) and whether a
-- DETACH ... CONCURRENTLY of it was interrupted. A partition of the records has the name and
-- bounds of its events' one, with the records table's name in front.
SELECT c.relname, pg_catalog.pg_get_expr(c.relpartbound, c.oid), i.inhdetachpending
  FROM pg_catalog.pg_inherits AS i
  JOIN pg_catalog.pg_class AS c ON c.oid = i.inhrelid
 WHERE i.inhparent = to_regclass('{events}')

-- name: newest_id
-- The last id handed out (committed or not): ranges below it may still receive an event
-- until its transaction ends; partitions are made ahead of it.
SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM {events_seq}

-- name: lock_maintenance
-- Transaction-scoped (a transaction pooler keeps it): two maintenances making partitions ahead
-- at once take turns, and the second finds them made.
SELECT pg_advisory_xact_lock(%(lock_space)s::integer, %(lock_key)s::integer)

-- name: create
-- A partition made apart and then attached: ATTACH takes a SHARE UPDATE EXCLUSIVE lock on the
-- partitioned table, which claims, enqueues and deliveries do not wait for (CREATE TABLE ...
-- PARTITION OF would take an ACCESS EXCLUSIVE one). The storage settings are migration_1's.
-- A lock_timeout bounds the wait for the lock; the next maintenance tries again.
SET LOCAL lock_timeout = '2s';
CREATE TABLE {partition} (LIKE {events} INCLUDING DEFAULTS INCLUDING CONSTRAINTS) WITH (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02
);
CREATE TABLE {records_partition} (LIKE {deliveries} INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
ALTER TABLE {events} ATTACH PARTITION {partition} FOR VALUES FROM ({lower}) TO ({upper});
ALTER TABLE {deliveries} ATTACH PARTITION {records_partition}
    FOR VALUES FROM ({lower}) TO ({upper})

-- name: finished
-- Whether every event of a partition was published before %(before)s: none due or in flight,
-- none dead (a dead letter is the operator's until purged), none published since; and how many
-- it holds. Each test is one probe of a partial index of the partition.
SELECT NOT EXISTS (SELECT FROM {partition} WHERE published_at IS NULL AND failed_at IS NULL)
   AND NOT EXISTS (SELECT FROM {partition} WHERE failed_at IS NOT NULL)
   AND NOT EXISTS (SELECT FROM {partition} WHERE published_at >= %(before)s::timestamptz),
       (SELECT count(*) FROM {partition})

-- name: detach
-- Without blocking claims or enqueues (it waits for the transactions that may use the
-- partition instead); not in a transaction block. An interrupted one is finished by
-- detach_finalize.
ALTER TABLE {events} DETACH PARTITION {partition} CONCURRENTLY

-- name: detach_records
ALTER TABLE {deliveries} DETACH PARTITION {records_partition} CONCURRENTLY

-- name: records_state
-- Whether the records' partition of a range is attached (a row), and then whether its detach
-- was interrupted.
SELECT i.inhdetachpending
  FROM pg_catalog.pg_inherits AS i
 WHERE i.inhparent = to_regclass('{deliveries}')
   AND i.inhrelid = to_regclass('{records_partition}')

-- name: detach_finalize
ALTER TABLE {events} DETACH PARTITION {partition} FINALIZE

-- name: detach_records_finalize
ALTER TABLE {deliveries} DETACH PARTITION {records_partition} FINALIZE

-- name: reattach
-- A detached partition that turned out unfinished (a transaction that had taken an id in its
-- range committed while it was detached) goes back.
ALTER TABLE {events} ATTACH PARTITION {partition} FOR VALUES FROM ({lower}) TO ({upper})

-- name: reattach_records
ALTER TABLE {deliveries} ATTACH PARTITION {records_partition}
    FOR VALUES FROM ({lower}) TO ({upper})

-- name: drop
DROP TABLE {partition}, {records_partition}
