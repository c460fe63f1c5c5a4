-- Queries of the data pipeline (dmq_pipeline), loaded by name with
-- dmq_sql.load_queries. Two kinds:
--  * bookkeeping run by the driver through psycopg (parameters %(name)s);
--  * `jdbc_*` blocks: the parenthesised, aliased subquery Spark's JDBC source
--    gets as `dbtable`. The driver renders their parameters as literals
--    (psycopg's client-side binding) before Spark sees them; Spark adds the
--    partition ranges on the alias's `id` column around them.

-- name: archive_lock
-- One archive run at a time per database (session-level lock, the driver's connection).
SELECT pg_try_advisory_lock(7361002);

-- name: archive_unlock
-- Release the archive lock.
SELECT pg_advisory_unlock(7361002);

-- name: archive_state
-- Where the archive lives, once archiving is enabled.
SELECT location, enabled_at FROM dmq_archive_state;

-- name: enable_archive
-- Enable archiving (swept messages are kept from now on) at a location.
INSERT INTO dmq_archive_state (location) VALUES (%(location)s)
ON CONFLICT (singleton) DO NOTHING;

-- name: archive_written_batches
-- Batches written to the archive location (its Parquet exists): the location binds.
SELECT count(*) FROM dmq_archive_batch WHERE state IN ('written', 'trimmed');

-- name: move_archive
-- A new location for an archive that has no batch written yet.
UPDATE dmq_archive_state SET location = %(location)s;

-- name: unfinished_archive_batch
-- The batch a previous run left planned or written, if any.
SELECT id, low_id, high_id, state, planned_rows, rows
FROM dmq_archive_batch WHERE state <> 'trimmed';

-- name: archive_watermark
-- Highest delivery-log id archived (or being archived): a dmq_delivery_batch id (a log row
-- id before schema version 10, which carried those over as batch ids).
SELECT coalesce(max(high_id), 0) FROM dmq_archive_batch;

-- name: next_archive_range
-- The next batch: the log's acknowledgement batches (dmq_delivery_batch rows, whose ids
-- the watermark counts since schema version 10) after the watermark, acknowledged before
-- the cutoff, as many as begin within max_rows facts; the facts they hold and the last id.
SELECT coalesce(sum(facts), 0), max(id)
FROM (SELECT id, facts, sum(facts) OVER (ORDER BY id) - facts AS facts_before
      FROM (SELECT id, cardinality(message_ids) AS facts FROM dmq_delivery_batch
            WHERE id > %(low)s AND acked_at < %(cutoff)s
            ORDER BY id
            LIMIT %(max_rows)s) AS next_batches) AS counted
WHERE facts_before < %(max_rows)s;

-- name: plan_archive_batch
-- Record a planned batch before anything is written.
INSERT INTO dmq_archive_batch (low_id, high_id, planned_rows)
VALUES (%(low)s, %(high)s, %(rows)s)
RETURNING id;

-- name: replan_archive_batch
-- A batch whose log range changed under it (a late commit) is written again.
UPDATE dmq_archive_batch
SET state = 'planned', rows = NULL, missing_messages = NULL, written_at = NULL
WHERE id = %(id)s;

-- name: mark_archive_written
-- The batch's Parquet is committed and holds `rows` rows.
UPDATE dmq_archive_batch
SET state = 'written', rows = %(rows)s, missing_messages = %(missing)s, written_at = now()
WHERE id = %(id)s AND state = 'planned';

-- name: trim_delivery_log
-- Delete an archived batch's log rows (same transaction as mark_archive_trimmed); how
-- many facts they held.
WITH gone AS (
    DELETE FROM dmq_delivery_batch WHERE id > %(low)s AND id <= %(high)s
    RETURNING cardinality(message_ids) AS facts
)
SELECT coalesce(sum(facts), 0) FROM gone;

-- name: trim_message_history
-- Kept messages that no remaining log row refers to are in the archive (or never will be).
DELETE FROM dmq_message_history h
WHERE NOT EXISTS (SELECT 1 FROM (SELECT unnest(message_ids) AS id FROM dmq_delivery_batch) AS l
                  WHERE l.id = h.id);

-- name: mark_archive_trimmed
-- The batch is finished.
UPDATE dmq_archive_batch SET state = 'trimmed', trimmed_at = now()
WHERE id = %(id)s AND state = 'written';

-- name: archive_batches
-- Every batch, newest first (status output and tests).
SELECT id, low_id, high_id, state, planned_rows, rows, missing_messages,
       planned_at, written_at, trimmed_at
FROM dmq_archive_batch ORDER BY id DESC;

-- name: jdbc_archive_rows
-- Delivery-log rows of one batch with the message each refers to (NULL columns if it is gone);
-- ack_batch is what Spark partitions the read on (a range of it reaches dmq_delivery_batch's
-- primary key through the view, a range of the fact id would not). The message's properties
-- (schema version 16): headers as JSON text, which the archive turns into a map.
(SELECT l.id, l.message_id, l.topic, l.channel, l.published_at, l.first_delivered_at,
        l.acked_at, l.attempts, m.producer, m.session_id, m.produced_at, m.node_id, m.body,
        m.key, m.priority, m.headers::text AS headers, l.ack_batch
 FROM dmq_delivery_log l
 LEFT JOIN (SELECT id, producer, session_id, produced_at, node_id, body, key, priority, headers
            FROM dmq_message
            UNION ALL
            SELECT id, producer, session_id, produced_at, node_id, body, key, priority, headers
            FROM dmq_message_history
           ) AS m ON m.id = l.message_id
 WHERE l.ack_batch > %(low)s AND l.ack_batch <= %(high)s) AS archive_rows

-- name: report_log_bounds
-- The acknowledgement batches holding the log rows a report reads (for partitioned reads):
-- how many rows, the lowest and highest batch. A batch's newest ack bounds its facts'.
SELECT count(*), min(ack_batch), max(ack_batch)
FROM dmq_delivery_log
WHERE ack_batch_at >= %(since)s AND acked_at >= %(since)s AND published_at < %(until)s
  AND (%(topic)s::text IS NULL OR topic = %(topic)s)
  AND (%(channel)s::text IS NULL OR channel = %(channel)s);

-- name: jdbc_report_log
-- Log rows that matter to a report over [since, until): acknowledged since `since`
-- (throughput, latency, attempts) and published before `until` (backlog over time).
(SELECT id, topic, channel, published_at, acked_at, attempts, ack_batch
 FROM dmq_delivery_log
 WHERE ack_batch_at >= %(since)s AND acked_at >= %(since)s AND published_at < %(until)s
   AND (%(topic)s::text IS NULL OR topic = %(topic)s)
   AND (%(channel)s::text IS NULL OR channel = %(channel)s)) AS report_log

-- name: jdbc_report_pending
-- Copies not yet acknowledged, published before `until` (backlog).
(SELECT d.message_id AS id, d.topic, d.channel, m.published_at, d.attempts
 FROM dmq_pending d JOIN dmq_message m ON m.id = d.message_id
 WHERE m.published_at < %(until)s
   AND (%(topic)s::text IS NULL OR d.topic = %(topic)s)
   AND (%(channel)s::text IS NULL OR d.channel = %(channel)s)) AS report_pending

-- name: jdbc_report_dead_letters
-- Dead letters that died in [since, until).
(SELECT id, topic, coalesce(channel, '') AS channel, reason, dead_at, replayed_at
 FROM dmq_dead_letter
 WHERE dead_at >= %(since)s AND dead_at < %(until)s
   AND (%(topic)s::text IS NULL OR topic = %(topic)s)
   AND (%(channel)s::text IS NULL OR channel = %(channel)s)) AS report_dead_letters

-- name: replay_selection
-- How many dead letters a replay selects, and their id range.
SELECT count(*), min(id), max(id)
FROM dmq_dead_letter
WHERE replayed_at IS NULL
  AND dead_at >= %(since)s AND dead_at < %(until)s
  AND (%(topic)s::text IS NULL OR topic = %(topic)s)
  AND (%(channel)s::text IS NULL OR channel = %(channel)s)
  AND (%(reason)s::text IS NULL OR reason = %(reason)s);

-- name: replay_selection_summary
-- The selection by topic, channel and reason (dry runs).
SELECT topic, coalesce(channel, '') AS channel, reason, count(*)
FROM dmq_dead_letter
WHERE replayed_at IS NULL
  AND dead_at >= %(since)s AND dead_at < %(until)s
  AND (%(topic)s::text IS NULL OR topic = %(topic)s)
  AND (%(channel)s::text IS NULL OR channel = %(channel)s)
  AND (%(reason)s::text IS NULL OR reason = %(reason)s)
GROUP BY 1, 2, 3 ORDER BY 1, 2, 3;

-- name: jdbc_replay_dead_letters
-- The dead letters to replay, bounded to the id range counted by replay_selection, with the
-- properties each is sent again with (schema version 16; headers as JSON text).
(SELECT id, topic, channel, reason, body, key, priority, headers::text AS headers
 FROM dmq_dead_letter
 WHERE replayed_at IS NULL AND id >= %(low)s AND id <= %(high)s
   AND dead_at >= %(since)s AND dead_at < %(until)s
   AND (%(topic)s::text IS NULL OR topic = %(topic)s)
   AND (%(channel)s::text IS NULL OR channel = %(channel)s)
   AND (%(reason)s::text IS NULL OR reason = %(reason)s)) AS replay_dead_letters

-- name: mark_replayed
-- Record replays (run by the executors, a small batch at a time); first replay wins.
UPDATE dmq_dead_letter d
SET replayed_at = now(), replay_message_id = u.message_id
FROM unnest(%(ids)s::bigint[], %(message_ids)s::bigint[]) AS u(id, message_id)
WHERE d.id = u.id AND d.replayed_at IS NULL;

-- name: replay_progress
-- Dead letters in a replay's id range marked replayed since it started.
SELECT count(*) FROM dmq_dead_letter
WHERE id >= %(low)s AND id <= %(high)s AND replayed_at >= %(started)s;

-- name: dead_letter_reasons
-- The reasons a dead letter may have (from the table's CHECK constraint).
SELECT pg_get_constraintdef(c.oid)
FROM pg_constraint c
WHERE c.conrelid = 'dmq_dead_letter'::regclass AND c.contype = 'c'
  AND pg_get_constraintdef(c.oid) LIKE '%%reason%%';

-- name: archive_stragglers
-- Log rows at or below the watermark: committed after their range was archived (rare).
SELECT coalesce(sum(cardinality(message_ids)), 0) FROM dmq_delivery_batch WHERE id <= %(watermark)s;

-- name: database_time
-- The database's clock (replay progress compares replayed_at with it).
SELECT now();

-- name: retained_start
-- What the retention sweep removed of a topic (schema version 20): nothing the topic still
-- holds was published at or before swept_ms. `dmq channel seek --from-archive` seeks to
-- swept_ms + 1 and `reinject` fills [since, swept_ms + 1) from the archive: the same edge.
SELECT swept_id, swept_ms FROM dmq_retention WHERE topic = %(topic)s;

-- name: reinject_messages
-- Queue one batch of archived messages (in id order) for one channel of their topic, due
-- now: move_due then stores each as a message of that channel only. Producer
-- 'dmq-archive:<channel>' with the original message id as session id: dmq_delay's
-- UNIQUE (producer, session_id) makes a second run queue nothing while the first run's
-- rows wait, and the NOT EXISTS (as insert_delayed) while their messages are stored
-- (move_due's ON CONFLICT on dmq_message closes the race between the two). All in fragment 1
-- (every server serves it): one worker moves them, in due order (dmq_pipeline.reinject).
-- Returns how many were queued.
WITH input AS (
    SELECT * FROM unnest(%(session_ids)s::bigint[], %(produced_ms)s::bigint[], %(bodies)s::bytea[],
                         %(keys)s::text[], %(priorities)s::smallint[], %(headers)s::text[])
             WITH ORDINALITY AS u(session_id, produced_ms, body, key, priority, headers, ord)
), queued AS (
    INSERT INTO dmq_delay (fragment, due_ms, topic, channel, producer, session_id, produced_ms,
                           node_id, body, key, priority, headers)
    SELECT 1, (extract(epoch FROM now()) * 1000)::bigint,
           %(topic)s, %(channel)s, %(producer)s, i.session_id, i.produced_ms, 'dmq-pipeline', i.body,
           i.key, i.priority, i.headers::jsonb
    FROM input i
    WHERE NOT EXISTS (SELECT 1 FROM dmq_message m
                      WHERE m.producer = %(producer)s AND m.session_id = i.session_id)
    ORDER BY i.ord
    ON CONFLICT (producer, session_id) DO NOTHING
    RETURNING id
)
SELECT count(*) FROM queued;

-- name: log_reinject
-- Audit a reinject as the admin surfaces audit theirs (dmq_admin_log, schema version 3).
INSERT INTO dmq_admin_log (surface, actor, operation, filters, affected)
VALUES ('pipeline', %(actor)s, 'channel.reinject', %(filters)s, %(affected)s);
