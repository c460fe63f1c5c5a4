-- Test-only statements for tests/pipeline (setup and observation).

-- name: insert_dead_letter
-- Dead letters are not produced by the server yet (the delay/dead-letter issue),
-- so tests insert them as that issue's server would.
INSERT INTO dmq_dead_letter (reason, detail, topic, channel, producer, session_id, message_id,
                             attempts, body, published_at, dead_at, replayed_at)
VALUES (%(reason)s, %(detail)s, %(topic)s, %(channel)s, 'test-producer', %(session_id)s, NULL,
        %(attempts)s, %(body)s, now() - interval '5 minutes', %(dead_at)s, %(replayed_at)s)
RETURNING id;

-- name: dead_letters
-- Every dead letter with its replay bookkeeping.
SELECT id, topic, channel, reason, body, replayed_at, replay_message_id
FROM dmq_dead_letter ORDER BY id;

-- name: forget_replays
-- Simulate a replay that crashed after sending and before recording: clear the marks.
UPDATE dmq_dead_letter SET replayed_at = NULL, replay_message_id = NULL
WHERE id = ANY(%(ids)s);

-- name: log_rows
-- Delivery-log rows with their message (what the archive must hold).
SELECT l.id, l.message_id, l.topic, l.channel, l.attempts, l.published_at, l.acked_at,
       m.producer, m.session_id, m.body
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
