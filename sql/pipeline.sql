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
-- Highest delivery-log id archived (or being archived).
SELECT coalesce(max(high_id), 0) FROM dmq_archive_batch;

-- name: next_archive_range
-- The next batch: at most max_rows log rows after the watermark, acknowledged before the cutoff.
SELECT count(*), max(id)
FROM (SELECT id FROM dmq_delivery_log
      WHERE id > %(low)s AND acked_at < %(cutoff)s
      ORDER BY id
      LIMIT %(max_rows)s) AS next_rows;

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
-- Delete an archived batch's log rows (same transaction as mark_archive_trimmed).
DELETE FROM dmq_delivery_log WHERE id > %(low)s AND id <= %(high)s;

-- name: trim_message_history
-- Kept messages that no remaining log row refers to are in the archive (or never will be).
DELETE FROM dmq_message_history h
WHERE NOT EXISTS (SELECT 1 FROM dmq_delivery_log l WHERE l.message_id = h.id);

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
-- Delivery-log rows of one batch with the message each refers to (NULL columns if it is gone).
(SELECT l.id, l.message_id, l.topic, l.channel, l.published_at, l.first_delivered_at,
        l.acked_at, l.attempts, m.producer, m.session_id, m.produced_at, m.node_id, m.body
 FROM dmq_delivery_log l
 LEFT JOIN (SELECT id, producer, session_id, produced_at, node_id, body FROM dmq_message
            UNION ALL
            SELECT id, producer, session_id, produced_at, node_id, body FROM dmq_message_history
           ) AS m ON m.id = l.message_id
 WHERE l.id > %(low)s AND l.id <= %(high)s) AS archive_rows

-- name: report_log_bounds
-- Id range of the log rows a report reads (for partitioned reads).
SELECT count(*), min(id), max(id)
FROM dmq_delivery_log
WHERE acked_at >= %(since)s AND published_at < %(until)s
  AND (%(topic)s::text IS NULL OR topic = %(topic)s)
  AND (%(channel)s::text IS NULL OR channel = %(channel)s);

-- name: jdbc_report_log
-- Log rows that matter to a report over [since, until): acknowledged since `since`
-- (throughput, latency, attempts) and published before `until` (backlog over time).
(SELECT id, topic, channel, published_at, acked_at, attempts
 FROM dmq_delivery_log
 WHERE acked_at >= %(since)s AND published_at < %(until)s
   AND (%(topic)s::text IS NULL OR topic = %(topic)s)
   AND (%(channel)s::text IS NULL OR channel = %(channel)s)) AS report_log

-- name: jdbc_report_pending
-- Copies not yet acknowledged, published before `until` (backlog).
(SELECT d.message_id AS id, d.topic, d.channel, m.published_at, d.attempts
 FROM dmq_delivery d JOIN dmq_message m ON m.id = d.message_id
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
-- The dead letters to replay, bounded to the id range counted by replay_selection.
(SELECT id, topic, channel, reason, body
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
SELECT count(*) FROM dmq_delivery_log WHERE id <= %(watermark)s;

-- name: database_time
-- The database's clock (replay progress compares replayed_at with it).
SELECT now();
