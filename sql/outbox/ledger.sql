-- The outbox relay's statements in dmq's OWN database (dmq_server.db.outbox_ledger):
-- dmq_outbox_relayed, the record of the outbox rows stored (schema version 13), and the
-- dead letters of rows that cannot be stored. Not in sql/queries.sql: the group commit
-- never runs these; the relay does, on its own connection, in autocommit.
-- The first five blocks are not statements but the parts that record outbox rows in the
-- group commit's own storing statements (schema version 15): db.messages adds them to
-- insert_messages as insert_outbox_messages, db.delays to insert_delayed as
-- insert_outbox_delayed, for a batch that holds outbox rows only.

-- name: record_stored
-- insert_outbox_messages' CTE ``claimed``: the pairs of the batch's outbox rows (producers
-- 'outbox:…' but not '…:delayed': a delayed one was recorded when it entered dmq_delay,
-- and its move into dmq_message is not a relay), those placed here while the owner is
-- not retired (``gate``: the batch's topics not placed here, NULL when the owner is
-- retired; a row not stored records nothing), recorded unless recorded before. The rows
-- go in the batch's order (sorted by pair: one lock order for concurrent writers).
INSERT INTO dmq_outbox_relayed (session_id, producer)
SELECT session_id, producer
FROM (SELECT unnest(%(topics)b::text[]) AS topic, unnest(%(producers)b::text[]) AS producer,
             unnest(%(session_ids)b::bigint[]) AS session_id) AS input
WHERE topic <> ALL((SELECT misplaced FROM gate)::text[])
  AND producer LIKE 'outbox:%%' AND producer NOT LIKE '%%:delayed'
ON CONFLICT (session_id, producer) DO NOTHING
RETURNING session_id, producer;

-- name: stored_if_recorded
-- insert_outbox_messages stores an outbox row only if recorded now: a pair recorded
-- before is a repeat (a relay died between its store and its delete), never stored
-- again, even once its message was swept. Other producers' rows are stored as always.
(producer NOT LIKE 'outbox:%%' OR producer LIKE '%%:delayed'
 OR (session_id, producer) IN (SELECT session_id, producer FROM claimed));

-- name: record_new_stored
-- insert_new_outbox_messages' CTE ``claimed``, the first try (as insert_new_messages, no ON
-- CONFLICT): the pairs of the outbox rows the statement stored, recorded after the fact. A
-- pair recorded before (a repeat whose message was swept; one still stored already failed
-- the message's insert) is a unique violation: the statement fails whole, nothing stored or
-- recorded, and insert_outbox_messages runs instead. Recording from the rows stored, not
-- before them from the input, costs 15,800 PostgreSQL instructions a message instead of
-- 23,200 (bench/pg_cost.py with outbox producers, session 31).
INSERT INTO dmq_outbox_relayed (session_id, producer)
SELECT session_id, producer FROM ins
WHERE producer LIKE 'outbox:%%' AND producer NOT LIKE '%%:delayed';

-- name: record_delayed
-- insert_outbox_delayed's CTE ``claimed``: as record_stored, of the rows insert_delayed
-- would store (not stored in dmq_message yet, placed here).
INSERT INTO dmq_outbox_relayed (session_id, producer)
SELECT i.session_id, i.producer FROM input i
WHERE i.producer LIKE 'outbox:%%'
  AND NOT EXISTS (SELECT 1 FROM dmq_message m WHERE m.producer = i.producer AND m.session_id = i.session_id)
  AND i.topic IN (SELECT name FROM placed)
ORDER BY i.producer, i.session_id
ON CONFLICT (session_id, producer) DO NOTHING
RETURNING session_id, producer;

-- name: delayed_if_recorded
-- insert_outbox_delayed stores an outbox row only if recorded now.
(i.producer NOT LIKE 'outbox:%%' OR (i.session_id, i.producer) IN (SELECT session_id, producer FROM claimed));

-- name: relayed_before
-- Which of these (producer, session_id) pairs were stored (or dead-lettered) before. This
-- and forget_relayed take a batch's pairs as binary arrays (dmq_server.db.arrays).
SELECT r.producer, r.session_id
FROM dmq_outbox_relayed r
JOIN unnest(%(producers)b::text[], %(session_ids)b::bigint[]) AS u(producer, session_id)
  ON r.session_id = u.session_id AND r.producer = u.producer;

-- name: dead_letter_rows
-- Rows that cannot be stored (an unknown topic, a body over --max-msg-size, ...) become
-- dead letters with the reason, recorded as relayed in the same statement: a row already
-- recorded is skipped, so a relay that dies before its delete records each once.
WITH input AS (
    SELECT * FROM unnest(%(topics)s::text[], %(producers)s::text[], %(session_ids)s::bigint[],
                         %(bodies)s::bytea[], %(details)s::text[], %(produced_ms)s::bigint[])
             AS u(topic, producer, session_id, body, detail, produced_ms)
), claimed AS (
    INSERT INTO dmq_outbox_relayed (session_id, producer)
    SELECT session_id, producer FROM input
    ON CONFLICT (session_id, producer) DO NOTHING
    RETURNING session_id, producer
)
INSERT INTO dmq_dead_letter (reason, detail, topic, producer, session_id, body, published_at)
SELECT 'client_reported', i.detail, i.topic, i.producer, i.session_id, i.body,
       timestamptz 'epoch' + i.produced_ms * interval '1 millisecond'
FROM input i JOIN claimed c ON c.session_id = i.session_id AND c.producer = i.producer
RETURNING id;

-- name: forget_relayed
-- The records of rows whose delete committed in the application's database. Each is found
-- through the primary key, then deleted by its tuple id: a join of the table with the
-- pairs was planned as a hash join over a scan of the whole table, whose dead records (a
-- record lives for a batch or two, and autovacuum comes a minute apart) made a forget of
-- 500 cost 0.6 ms with 1,000 rows in the table and 1.7 ms with 27,000 (a relay's drain of
-- 40,000 rows); by key it costs 0.8-0.9 ms at either size (EXPLAIN ANALYZE, session 31).
DELETE FROM dmq_outbox_relayed
WHERE ctid = ANY (ARRAY(
    SELECT (SELECT r.ctid FROM dmq_outbox_relayed r WHERE r.session_id = u.session_id AND r.producer = u.producer)
    FROM unnest(%(producers)b::text[], %(session_ids)b::bigint[]) AS u(producer, session_id)));

-- name: recorded_rows
-- The records of an outbox whose session id is its row's id (the relay's own numbering),
-- so a relay taking over can drop those of rows no longer in the outbox (a relay that died
-- between its delete and forget_relayed leaves them).
SELECT producer, session_id FROM dmq_outbox_relayed
WHERE producer = ANY(%(producers)s::text[])
ORDER BY session_id
LIMIT %(limit)s;
