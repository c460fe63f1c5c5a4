-- Test-only statements for tests/pipeline (setup and observation).

-- name: insert_dead_letter
-- Dead letters are not produced by the server yet (the delay/dead-letter issue),
-- so tests insert them as that issue's server would.
-- With its message's properties (schema version 16; headers as JSON text or NULL).
INSERT INTO dmq_dead_letter (reason, detail, topic, channel, producer, session_id, message_id,
                             attempts, body, published_at, dead_at, replayed_at, key, priority, headers)
VALUES (%(reason)s, %(detail)s, %(topic)s, %(channel)s, 'test-producer', %(session_id)s, NULL,
        %(attempts)s, %(body)s, now() - interval '5 minutes', %(dead_at)s, %(replayed_at)s,
        %(key)s, %(priority)s, %(headers)s::jsonb)
RETURNING id;

-- name: dead_letters
-- Every dead letter with its replay bookkeeping.
SELECT id, topic, channel, reason, body, replayed_at, replay_message_id
FROM dmq_dead_letter ORDER BY id;

-- name: message_ids
-- Ids of the messages kept, stored or swept into the history.
SELECT id FROM dmq_message UNION ALL SELECT id FROM dmq_message_history ORDER BY 1;

-- name: set_message_properties
-- Give messages properties where they are kept (dmq_message, or dmq_message_history once
-- swept), as the server stores a send's; how many rows changed. Arrays by message:
-- ids, keys, priorities, headers (JSON text or NULL).
WITH p AS (SELECT * FROM unnest(%(ids)s::bigint[], %(keys)s::text[], %(priorities)s::smallint[],
                                %(headers)s::text[]) AS p(id, key, priority, headers)),
     live AS (UPDATE dmq_message m SET key = p.key, priority = p.priority, headers = p.headers::jsonb
              FROM p WHERE m.id = p.id RETURNING m.id),
     kept AS (UPDATE dmq_message_history h SET key = p.key, priority = p.priority, headers = p.headers::jsonb
              FROM p WHERE h.id = p.id RETURNING h.id)
SELECT (SELECT count(*) FROM live) + (SELECT count(*) FROM kept);

-- name: forget_replays
-- Simulate a replay that crashed after sending and before recording: clear the marks.
UPDATE dmq_dead_letter SET replayed_at = NULL, replay_message_id = NULL
WHERE id = ANY(%(ids)s);

-- name: log_rows
-- Delivery-log rows with their message (what the archive must hold).
SELECT l.id, l.message_id, l.topic, l.channel, l.attempts, l.published_at, l.acked_at,
       m.producer, m.session_id, m.body, m.key, m.priority, m.headers
FROM dmq_delivery_log l JOIN dmq_message m ON m.id = l.message_id
ORDER BY l.id;

-- name: log_ids
-- Ids of the delivery log rows still in PostgreSQL.
SELECT id FROM dmq_delivery_log ORDER BY id;

-- name: counts
-- Row counts of the tables the pipeline reads or changes.
SELECT (SELECT count(*) FROM dmq_message) AS messages,
       (SELECT count(*) FROM dmq_pending) AS deliveries,
       (SELECT count(*) FROM dmq_delivery_log) AS log,
       (SELECT count(*) FROM dmq_message_history) AS history,
       (SELECT count(*) FROM dmq_archive_batch) AS batches,
       (SELECT count(*) FROM dmq_archive_state) AS archive_state,
       (SELECT count(*) FROM dmq_dead_letter WHERE replayed_at IS NOT NULL) AS replayed,
       (SELECT max(version) FROM dmq_schema_version) AS schema_version;

-- name: batches
-- Archive batches, oldest first.
SELECT id, low_id, high_id, state, rows, missing_messages FROM dmq_archive_batch ORDER BY id;

-- name: log_batches
-- The log's acknowledgement batches (schema version 10): id and how many facts each holds.
SELECT id, cardinality(message_ids) FROM dmq_delivery_batch ORDER BY id;

-- name: take_log_batch
-- Hide an acknowledgement batch (a transaction that has taken its id but not committed yet).
DELETE FROM dmq_delivery_batch WHERE id = %(id)s
RETURNING id, first_fact, acked_at, low_id, high_id, topics, channels, message_ids, published_ms,
          first_ms, acked_ms, attempts, consumers, delivered_ms;

-- name: put_log_batch
-- Commit a hidden acknowledgement batch late, with its original id.
INSERT INTO dmq_delivery_batch (id, first_fact, acked_at, low_id, high_id, topics, channels, message_ids,
                                published_ms, first_ms, acked_ms, attempts, consumers, delivered_ms)
VALUES (%(id)s, %(first_fact)s, %(acked_at)s, %(low_id)s, %(high_id)s, %(topics)s, %(channels)s,
        %(message_ids)s, %(published_ms)s, %(first_ms)s, %(acked_ms)s, %(attempts)s, %(consumers)s,
        %(delivered_ms)s);

-- name: replayed_bodies
-- Bodies of dead letters recorded as replayed whose message the server stored.
SELECT m.body FROM dmq_dead_letter dl JOIN dmq_message m ON m.id = dl.replay_message_id
WHERE dl.replayed_at IS NOT NULL ORDER BY dl.id;

-- name: replayed_properties
-- Each replayed dead letter's body and properties beside those of the message the server stored.
SELECT dl.body, dl.key, dl.priority, dl.headers, m.key, m.priority, m.headers
FROM dmq_dead_letter dl JOIN dmq_message m ON m.id = dl.replay_message_id
WHERE dl.replayed_at IS NOT NULL ORDER BY dl.id;
