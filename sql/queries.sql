-- name: create_schema_version
-- The migration ledger; created under the migration lock, before any migration runs.
CREATE TABLE IF NOT EXISTS dmq_schema_version (
    version     integer PRIMARY KEY,
    description text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- name: lock_migrations
-- Serialise concurrent migrators (two nodes starting at once).
SELECT pg_advisory_xact_lock(7361001);

-- name: schema_versions
-- Versions already applied.
SELECT version FROM dmq_schema_version ORDER BY version;

-- name: record_migration
-- Mark one migration applied.
INSERT INTO dmq_schema_version (version, description) VALUES (%(version)s, %(description)s);

-- name: ping
-- Is the database answering?
SELECT 1;

-- name: list_topics
-- Every topic with its settings and channels, for the registry cache and the CLI.
SELECT t.name, t.store, t.msg_timeout_ms, t.rate_limit, t.ttl_ms, t.max_attempts,
       coalesce(array_agg(c.name ORDER BY c.name) FILTER (WHERE c.name IS NOT NULL), '{}') AS channels
FROM dmq_topic t LEFT JOIN dmq_channel c ON c.topic = t.name
GROUP BY t.name
ORDER BY t.name;

-- name: create_topic
-- Register a topic; returns nothing if it already exists.
INSERT INTO dmq_topic (name, store, msg_timeout_ms, rate_limit, ttl_ms, max_attempts)
VALUES (%(name)s, %(store)s, %(msg_timeout_ms)s, %(rate_limit)s, %(ttl_ms)s, %(max_attempts)s)
ON CONFLICT (name) DO NOTHING
RETURNING name;

-- name: lock_topic_settings
-- One topic's changeable settings, the row locked until the update commits.
SELECT msg_timeout_ms, rate_limit, ttl_ms, max_attempts FROM dmq_topic WHERE name = %(name)s FOR UPDATE;

-- name: update_topic_settings
-- Replace a topic's settings (not its store, not its channels).
UPDATE dmq_topic
SET msg_timeout_ms = %(msg_timeout_ms)s, rate_limit = %(rate_limit)s,
    ttl_ms = %(ttl_ms)s, max_attempts = %(max_attempts)s
WHERE name = %(name)s;

-- name: delete_topic
-- Remove a topic, its channels (cascade) and its undelivered copies.
WITH gone AS (DELETE FROM dmq_topic WHERE name = %(name)s RETURNING name),
     copies AS (DELETE FROM dmq_delivery WHERE topic = %(name)s)
SELECT name FROM gone;

-- name: add_channel
-- Register a channel (consumer group) on a topic; nothing if already there.
INSERT INTO dmq_channel (topic, name) VALUES (%(topic)s, %(name)s)
ON CONFLICT (topic, name) DO NOTHING
RETURNING name;

-- name: remove_channel
-- Unregister a channel and drop its undelivered copies.
WITH gone AS (DELETE FROM dmq_channel WHERE topic = %(topic)s AND name = %(name)s RETURNING name),
     copies AS (DELETE FROM dmq_delivery WHERE topic = %(topic)s AND channel = %(name)s)
SELECT name FROM gone;

-- name: insert_messages
-- Group commit: store a batch and one delivery per channel registered at commit time.
-- Array parameters use binary placeholders: text arrays cost the server ~20 us a row.
-- Rows whose (producer, session_id) is already stored are skipped (resends).
-- produced_ms is the producer's clock: only Unix milliseconds up to 9999-12-31 become a
-- timestamp, so no value can fail the whole batch (the broker refuses others first).
WITH input AS (
    SELECT * FROM unnest(%(topics)b::text[], %(producers)b::text[], %(session_ids)b::bigint[],
                         %(produced_ms)b::bigint[], %(bodies)b::bytea[])
             WITH ORDINALITY AS u(topic, producer, session_id, produced_ms, body, ord)
), ins AS (
    INSERT INTO dmq_message (topic, producer, session_id, produced_at, node_id, body)
    SELECT topic, producer, session_id,
           CASE WHEN produced_ms BETWEEN 1 AND 253402300799999 THEN to_timestamp(produced_ms / 1000.0) END,
           %(node_id)s, body
    FROM input ORDER BY producer, session_id  -- one lock order: concurrent writers cannot deadlock
    ON CONFLICT (producer, session_id) DO NOTHING
    RETURNING id, topic, producer, session_id, published_at
), channels AS (
    -- the same snapshot as the insert below, so this is exactly the set that got rows
    SELECT c.topic, array_agg(c.name ORDER BY c.name) AS names
    FROM dmq_channel c
    WHERE c.topic IN (SELECT DISTINCT topic FROM input)
    GROUP BY c.topic
), deliveries AS (
    INSERT INTO dmq_delivery (topic, channel, message_id, owner)
    SELECT ins.topic, unnest(ch.names), ins.id, %(node_id)s
    FROM ins JOIN channels ch ON ch.topic = ins.topic
)
SELECT ins.id, ins.producer, ins.session_id,
       (extract(epoch FROM ins.published_at) * 1000)::bigint AS published_ms,
       coalesce(ch.names, '{}') AS channels
FROM ins LEFT JOIN channels ch ON ch.topic = ins.topic;

-- name: find_messages
-- The stored rows for resent (producer, session_id) pairs.
SELECT m.id, m.producer, m.session_id,
       (extract(epoch FROM m.published_at) * 1000)::bigint AS published_ms
FROM dmq_message m
JOIN unnest(%(producers)b::text[], %(session_ids)b::bigint[]) AS u(producer, session_id)
  ON m.producer = u.producer AND m.session_id = u.session_id;

-- name: ack_deliveries
-- Make a batch of acknowledgements durable: drop the delivery rows, log them, with the
-- consumer that acknowledged each and when that delivery was pushed (the message trace).
WITH input AS (
    SELECT * FROM unnest(%(topics)b::text[], %(channels)b::text[], %(message_ids)b::bigint[],
                         %(first_ms)b::bigint[], %(acked_ms)b::bigint[], %(attempts)b::integer[],
                         %(consumers)b::text[], %(delivered_ms)b::bigint[])
             AS u(topic, channel, message_id, first_ms, acked_ms, attempts, consumer, delivered_ms)
), acked AS (
    DELETE FROM dmq_delivery d USING input u
    WHERE d.topic = u.topic AND d.channel = u.channel AND d.message_id = u.message_id
    RETURNING d.message_id, d.topic, d.channel, u.first_ms, u.acked_ms,
              greatest(u.attempts, d.attempts) AS attempts, u.consumer, u.delivered_ms
)
INSERT INTO dmq_delivery_log (message_id, topic, channel, published_at, first_delivered_at,
                              acked_at, attempts, consumer, delivered_at)
SELECT a.message_id, a.topic, a.channel, m.published_at,
       CASE WHEN a.first_ms > 0 THEN to_timestamp(a.first_ms / 1000.0) END,
       to_timestamp(a.acked_ms / 1000.0), a.attempts, a.consumer,
       CASE WHEN a.delivered_ms > 0 THEN to_timestamp(a.delivered_ms / 1000.0) END
FROM acked a JOIN dmq_message m ON m.id = a.message_id;

-- name: load_backlog
-- Stored, unacknowledged copies for one channel after a cursor, oldest first.
SELECT m.id, m.producer, m.session_id,
       (extract(epoch FROM m.published_at) * 1000)::bigint AS published_ms,
       m.body, d.attempts
FROM dmq_delivery d JOIN dmq_message m ON m.id = d.message_id
WHERE d.topic = %(topic)s AND d.channel = %(channel)s AND d.message_id > %(after)s
ORDER BY d.message_id
LIMIT %(limit)s;

-- name: sweep_messages
-- Remove fully acknowledged messages older than the retention window (bounded batch).
DELETE FROM dmq_message
WHERE id IN (
    SELECT m.id FROM dmq_message m
    WHERE m.published_at < now() - make_interval(secs => %(retention_s)s)
      AND NOT EXISTS (SELECT 1 FROM dmq_channel c JOIN dmq_delivery d
                      ON d.topic = c.topic AND d.channel = c.name AND d.message_id = m.id
                      WHERE c.topic = m.topic)
    ORDER BY m.id
    LIMIT %(limit)s
);

-- name: channel_depths
-- Stored, unacknowledged copies per channel.
SELECT topic, channel, count(*) AS depth
FROM dmq_delivery GROUP BY topic, channel ORDER BY topic, channel;

-- name: table_counts
-- Row counts for `dmq stats`.
SELECT (SELECT count(*) FROM dmq_message) AS messages,
       (SELECT count(*) FROM dmq_delivery) AS deliveries,
       (SELECT count(*) FROM dmq_delivery_log) AS delivery_log,
       (SELECT count(*) FROM dmq_dead_letter) AS dead_letters;

-- ---------------------------------------------------------------------------
-- Delayed messages, dead letters, limits and admin (schema version 3)
-- ---------------------------------------------------------------------------

-- name: insert_delayed
-- Store a batch of delayed messages; a (producer, session_id) already stored here
-- or in dmq_message is skipped (a resend) and looked up by find_delayed.
WITH input AS (
    SELECT * FROM unnest(%(topics)b::text[], %(producers)b::text[], %(session_ids)b::bigint[],
                         %(produced_ms)b::bigint[], %(due_ms)b::bigint[], %(fragments)b::integer[],
                         %(bodies)b::bytea[])
             AS u(topic, producer, session_id, produced_ms, due_ms, fragment, body)
)
INSERT INTO dmq_delay (fragment, due_ms, topic, producer, session_id, produced_ms, node_id, body)
SELECT i.fragment, i.due_ms, i.topic, i.producer, i.session_id, i.produced_ms, %(node_id)s, i.body
FROM input i
WHERE NOT EXISTS (SELECT 1 FROM dmq_message m
                  WHERE m.producer = i.producer AND m.session_id = i.session_id)
ORDER BY i.producer, i.session_id  -- one lock order, as insert_messages
ON CONFLICT (producer, session_id) DO NOTHING
RETURNING id, producer, session_id, due_ms;

-- name: find_delayed
-- The stored row of resent delayed pairs: still waiting (kind 'delay') or already
-- moved into the reliable flow (kind 'message').
SELECT d.id, d.producer, d.session_id, d.due_ms, 'delay' AS kind
FROM dmq_delay d
JOIN unnest(%(producers)b::text[], %(session_ids)b::bigint[]) AS u(producer, session_id)
  ON d.producer = u.producer AND d.session_id = u.session_id
UNION ALL
SELECT m.id, m.producer, m.session_id, 0, 'message'
FROM dmq_message m
JOIN unnest(%(producers)b::text[], %(session_ids)b::bigint[]) AS u(producer, session_id)
  ON m.producer = u.producer AND m.session_id = u.session_id;

-- name: peek_delayed
-- Due times in a worker's fragments up to a horizon (the next polling window), so
-- the worker can hold a timer for each instead of waiting for its next poll.
-- `overflow` adds fragments above max_fragment (rows left by a larger --delay-fragments).
SELECT due_ms FROM dmq_delay
WHERE (fragment = ANY(%(fragments)s::integer[])
       OR (%(overflow)s AND fragment > %(max_fragment)s))
  AND due_ms <= %(until_ms)s
ORDER BY due_ms
LIMIT %(limit)s;

-- name: move_due
-- Move due rows of a worker's fragments into the reliable flow in one transaction:
-- lock them (SKIP LOCKED: another worker or node never takes the same row), delete
-- them, insert each as a message with a delivery per target channel (the row's own
-- channel for a replay, else every channel registered now), point a replayed dead
-- letter at its new message, and keep a row whose channels are all gone as a dead
-- letter. Returns how many rows were taken, and the messages for the in-memory channels.
WITH due AS MATERIALIZED (
    SELECT id FROM dmq_delay
    WHERE (fragment = ANY(%(fragments)s::integer[])
           OR (%(overflow)s AND fragment > %(max_fragment)s))
      AND due_ms <= %(now_ms)s
    ORDER BY due_ms, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM dmq_delay d USING due WHERE d.id = due.id
    RETURNING d.id AS delay_id, d.topic, d.channel, d.producer, d.session_id, d.produced_ms,
              d.due_ms, d.replay_of, d.body
), targets AS (
    SELECT mv.delay_id, array_agg(c.name ORDER BY c.name) AS names
    FROM moved mv
    JOIN dmq_channel c ON c.topic = mv.topic AND (mv.channel IS NULL OR c.name = mv.channel)
    GROUP BY mv.delay_id
), numbered AS MATERIALIZED (
    -- message ids drawn here, so the rows stored below are found again by id in
    -- an array rather than by joining the INSERT's output back to `moved`: that
    -- join is planned from row estimates, and right after many rows became due
    -- at once (a bulk replay) the estimates say one row and the plan goes quadratic
    SELECT mv.*, t.names, nextval(pg_get_serial_sequence('dmq_message', 'id')) AS message_id
    FROM moved mv JOIN targets t ON t.delay_id = mv.delay_id
), ins AS (
    INSERT INTO dmq_message (id, topic, producer, session_id, produced_at, node_id, body)
    SELECT n.message_id, n.topic, n.producer, n.session_id,
           CASE WHEN n.produced_ms BETWEEN 1 AND 253402300799999 THEN to_timestamp(n.produced_ms / 1000.0) END,
           %(node_id)s, n.body
    FROM numbered n
    ORDER BY n.producer, n.session_id
    ON CONFLICT (producer, session_id) DO NOTHING
    RETURNING id
), placed AS (
    -- published_at defaults to now(), the same for every row of this statement
    SELECT n.message_id AS id, now() AS published_at, n.delay_id, n.topic, n.channel, n.producer,
           n.session_id, n.produced_ms, n.due_ms, n.replay_of, n.body, n.names
    FROM numbered n
    WHERE n.message_id = ANY (ARRAY(SELECT id FROM ins))
), deliveries AS (
    INSERT INTO dmq_delivery (topic, channel, message_id, owner)
    SELECT p.topic, unnest(p.names), p.id, %(node_id)s FROM placed p
), replayed AS (
    UPDATE dmq_dead_letter dl SET replay_message_id = p.id
    FROM placed p WHERE dl.id = p.replay_of
), orphans AS (
    INSERT INTO dmq_dead_letter (reason, detail, topic, channel, producer, session_id, body)
    SELECT 'operator',
           CASE WHEN mv.channel IS NULL
                THEN 'topic had no registered channel when the delayed message fell due'
                ELSE 'channel ' || mv.channel || ' was not registered when the replay fell due' END,
           mv.topic, mv.channel, mv.producer, mv.session_id, mv.body
    FROM moved mv WHERE NOT EXISTS (SELECT 1 FROM targets t WHERE t.delay_id = mv.delay_id)
)
SELECT (SELECT count(*) FROM moved) AS taken,  -- always one row, also when nothing was placed
       p.id, p.topic, p.producer, p.session_id,
       (extract(epoch FROM p.published_at) * 1000)::bigint AS published_ms,
       p.names, p.due_ms, p.body
FROM (SELECT 1) AS one LEFT JOIN placed p ON true
ORDER BY p.id;

-- name: delay_stats
-- Waiting delayed messages per fragment.
SELECT fragment, count(*) AS pending, min(due_ms) AS next_due_ms, max(due_ms) AS last_due_ms
FROM dmq_delay GROUP BY fragment ORDER BY fragment;

-- name: insert_dead_letters
-- Record a batch of dead letters (rate limited sends, client reports).
INSERT INTO dmq_dead_letter (reason, detail, topic, channel, producer, session_id, message_id,
                             attempts, body, published_at)
SELECT u.reason, u.detail, u.topic, u.channel, u.producer, u.session_id, u.message_id,
       u.attempts, u.body,
       CASE WHEN u.published_ms BETWEEN 1 AND 253402300799999 THEN to_timestamp(u.published_ms / 1000.0) END
FROM unnest(%(reasons)s::text[], %(details)s::text[], %(topics)s::text[], %(channels)s::text[],
            %(producers)s::text[], %(session_ids)s::bigint[], %(message_ids)s::bigint[],
            %(attempts)s::integer[], %(bodies)b::bytea[], %(published_ms)s::bigint[])
     WITH ORDINALITY AS u(reason, detail, topic, channel, producer, session_id, message_id,
                          attempts, body, published_ms, ord)
ORDER BY u.ord
RETURNING id;

-- name: record_attempts
-- Persist delivery attempts (batched), so max attempts survives a restart.
UPDATE dmq_delivery d SET attempts = greatest(d.attempts, u.attempts)
FROM unnest(%(topics)b::text[], %(channels)b::text[], %(message_ids)b::bigint[],
            %(attempts)b::integer[]) AS u(topic, channel, message_id, attempts)
WHERE d.topic = u.topic AND d.channel = u.channel AND d.message_id = u.message_id;

-- name: exhaust_deliveries
-- Copies that used up their topic's max attempts: delivery row -> dead letter.
WITH input AS (
    SELECT * FROM unnest(%(topics)b::text[], %(channels)b::text[], %(message_ids)b::bigint[],
                         %(attempts)b::integer[]) AS u(topic, channel, message_id, attempts)
), gone AS (
    DELETE FROM dmq_delivery d USING input u
    WHERE d.topic = u.topic AND d.channel = u.channel AND d.message_id = u.message_id
    RETURNING d.topic, d.channel, d.message_id, greatest(d.attempts, u.attempts) AS attempts
)
INSERT INTO dmq_dead_letter (reason, detail, topic, channel, producer, session_id, message_id,
                             attempts, body, published_at)
SELECT 'max_attempts', 'delivered ' || g.attempts || ' times without acknowledgement',
       g.topic, g.channel, m.producer, m.session_id, m.id, g.attempts, m.body, m.published_at
FROM gone g JOIN dmq_message m ON m.id = g.message_id
RETURNING topic, channel, message_id;

-- name: expire_deliveries
-- Copies not acknowledged within their topic's time to live -> dead letters
-- (bounded batch, SKIP LOCKED so two nodes sweeping at once split the work).
WITH expired AS MATERIALIZED (
    SELECT d.topic, d.channel, d.message_id, t.ttl_ms
    FROM dmq_delivery d
    JOIN dmq_topic t ON t.name = d.topic
    JOIN dmq_message m ON m.id = d.message_id
    WHERE t.ttl_ms IS NOT NULL
      AND m.published_at < to_timestamp(%(now_ms)s / 1000.0) - make_interval(secs => t.ttl_ms / 1000.0)
    ORDER BY d.message_id
    LIMIT %(limit)s
    FOR UPDATE OF d SKIP LOCKED
), gone AS (
    DELETE FROM dmq_delivery d USING expired e
    WHERE d.topic = e.topic AND d.channel = e.channel AND d.message_id = e.message_id
    RETURNING d.topic, d.channel, d.message_id, d.attempts, e.ttl_ms
)
INSERT INTO dmq_dead_letter (reason, detail, topic, channel, producer, session_id, message_id,
                             attempts, body, published_at)
SELECT 'expired', 'not acknowledged within the topic''s time to live of ' || g.ttl_ms || ' ms',
       g.topic, g.channel, m.producer, m.session_id, m.id, g.attempts, m.body, m.published_at
FROM gone g JOIN dmq_message m ON m.id = g.message_id
RETURNING topic, channel, message_id;

-- fragment: dead_letter_filter
-- The selection of every dead-letter operation (list, count, replay, delete): each
-- NULL parameter matches everything. Statements use it after WHERE, as a comment
-- holding its name between slash-stars.
(%(topic)s::text IS NULL OR topic = %(topic)s::text)
  AND (%(channel)s::text IS NULL OR channel = %(channel)s::text)
  AND (%(reason)s::text IS NULL OR reason = %(reason)s::text)
  AND (%(since_ms)s::bigint IS NULL OR dead_at >= to_timestamp(%(since_ms)s::bigint / 1000.0))
  AND (%(until_ms)s::bigint IS NULL OR dead_at < to_timestamp(%(until_ms)s::bigint / 1000.0))
  AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
  AND (%(message_ids)s::bigint[] IS NULL OR message_id = ANY(%(message_ids)s::bigint[]))
  AND (%(replayed)s::boolean IS NULL OR (replayed_at IS NOT NULL) = %(replayed)s::boolean)

-- name: list_dead_letters
-- Dead letters matching the filters (each NULL filter matches all), after a keyset cursor.
SELECT id, reason, detail, topic, channel, producer, session_id, message_id, attempts,
       length(body) AS size,
       (extract(epoch FROM published_at) * 1000)::bigint AS published_ms,
       (extract(epoch FROM dead_at) * 1000)::bigint AS dead_ms,
       (extract(epoch FROM replayed_at) * 1000)::bigint AS replayed_ms,
       replay_message_id
FROM dmq_dead_letter
WHERE /*dead_letter_filter*/
  AND id > %(after)s
ORDER BY id
LIMIT %(limit)s;

-- name: count_dead_letters
-- How many dead letters match the filters (progress totals), and how many are not yet replayed.
SELECT count(*), count(*) FILTER (WHERE replayed_at IS NULL)
FROM dmq_dead_letter
WHERE /*dead_letter_filter*/;

-- name: show_dead_letter
-- One dead letter with its body.
SELECT id, reason, detail, topic, channel, producer, session_id, message_id, attempts,
       length(body) AS size,
       (extract(epoch FROM published_at) * 1000)::bigint AS published_ms,
       (extract(epoch FROM dead_at) * 1000)::bigint AS dead_ms,
       (extract(epoch FROM replayed_at) * 1000)::bigint AS replayed_ms,
       replay_message_id, body
FROM dmq_dead_letter WHERE id = %(id)s;

-- name: replay_dead_letters
-- Replay one batch (keyset after `after`): mark the dead letters replayed and queue
-- each, due now, in dmq_delay for its own channel (NULL: every channel) in the same
-- transaction. Producer 'dmq-replay' with session id = the dead letter's id makes a
-- second replay of the same dead letter a no-op even if the mark were lost. Returns
-- the highest id looked at (the next cursor) and how many were queued.
WITH picked AS MATERIALIZED (
    SELECT id FROM dmq_dead_letter
    WHERE /*dead_letter_filter*/
      AND replayed_at IS NULL
      AND id > %(after)s
    ORDER BY id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), marked AS (
    UPDATE dmq_dead_letter dl SET replayed_at = now()
    FROM picked WHERE dl.id = picked.id
    RETURNING dl.id, dl.topic, dl.channel, dl.body
), queued AS (
    INSERT INTO dmq_delay (fragment, due_ms, topic, channel, producer, session_id, replay_of,
                           node_id, body)
    SELECT 1 + mod(m.id, %(fragments)s), %(now_ms)s, m.topic, m.channel, 'dmq-replay', m.id, m.id,
           %(node_id)s, m.body
    FROM marked m
    ON CONFLICT (producer, session_id) DO NOTHING
    RETURNING id
)
SELECT (SELECT max(id) FROM picked), (SELECT count(*) FROM queued);

-- name: delete_dead_letters
-- Delete one batch of matching dead letters (keyset after `after`); returns the ids.
DELETE FROM dmq_dead_letter
WHERE id IN (
    SELECT id FROM dmq_dead_letter
    WHERE /*dead_letter_filter*/
      AND id > %(after)s
    ORDER BY id
    LIMIT %(limit)s
)
RETURNING id;

-- name: dead_letter_counts
-- Dead letters per reason, and how many of them were replayed.
SELECT reason, count(*), count(replayed_at) FROM dmq_dead_letter GROUP BY reason ORDER BY reason;

-- name: log_admin_operation
-- Audit one destructive admin operation.
INSERT INTO dmq_admin_log (surface, actor, operation, filters, affected)
VALUES (%(surface)s, %(actor)s, %(operation)s, %(filters)s, %(affected)s);

-- ---------------------------------------------------------------------------
-- Cluster: ZooKeeper registry mirror, owned backlog, takeover
-- ---------------------------------------------------------------------------

-- name: lock_registry_mirror
-- Serialise nodes copying ZooKeeper's topics and channels into dmq_topic/dmq_channel.
SELECT pg_advisory_xact_lock(7361002);

-- name: upsert_topic
-- Register a topic or replace its settings (the registry mirror; ZooKeeper decides).
INSERT INTO dmq_topic (name, store, msg_timeout_ms, rate_limit, ttl_ms, max_attempts)
VALUES (%(name)s, %(store)s, %(msg_timeout_ms)s, %(rate_limit)s, %(ttl_ms)s, %(max_attempts)s)
ON CONFLICT (name) DO UPDATE
SET store = EXCLUDED.store, msg_timeout_ms = EXCLUDED.msg_timeout_ms,
    rate_limit = EXCLUDED.rate_limit, ttl_ms = EXCLUDED.ttl_ms,
    max_attempts = EXCLUDED.max_attempts;

-- name: load_owned_backlog
-- Stored, unacknowledged copies for one channel that this node owns, after a cursor,
-- oldest first (in a cluster every node delivers only the copies it owns).
SELECT m.id, m.producer, m.session_id,
       (extract(epoch FROM m.published_at) * 1000)::bigint AS published_ms,
       m.body, d.attempts
FROM dmq_delivery d JOIN dmq_message m ON m.id = d.message_id
WHERE d.topic = %(topic)s AND d.channel = %(channel)s AND d.message_id > %(after)s
  AND d.owner = %(owner)s
ORDER BY d.message_id
LIMIT %(limit)s;

-- name: delivery_owners
-- The distinct owners of unacknowledged copies: a loose index scan (one probe per
-- owner) when dmq_delivery has an index led by owner, a full scan otherwise.
WITH RECURSIVE owners AS (
    (SELECT owner FROM dmq_delivery ORDER BY owner LIMIT 1)
    UNION ALL
    SELECT (SELECT d.owner FROM dmq_delivery d WHERE d.owner > o.owner ORDER BY d.owner LIMIT 1)
    FROM owners o WHERE o.owner IS NOT NULL
)
SELECT owner FROM owners WHERE owner IS NOT NULL;

-- name: claim_deliveries
-- Takeover: move one batch of a departed node's unacknowledged copies to this node.
-- A row changes owner only while it still has the departed one (another claimer
-- cannot take it twice); rows locked by a concurrent claimer are skipped.
-- Returns how many copies of each channel were claimed.
WITH batch AS (
    SELECT topic, channel, message_id FROM dmq_delivery
    WHERE owner = %(dead)s
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE dmq_delivery d SET owner = %(owner)s
    FROM batch b
    WHERE d.topic = b.topic AND d.channel = b.channel AND d.message_id = b.message_id
      AND d.owner = %(dead)s
    RETURNING d.topic, d.channel
)
SELECT topic, channel, count(*) FROM claimed GROUP BY topic, channel ORDER BY topic, channel;

-- name: owner_depths
-- Unacknowledged copies per owning node (cluster view for `dmq stats` and operators).
SELECT owner, count(*) AS copies FROM dmq_delivery GROUP BY owner ORDER BY owner;

-- name: channel_pauses
-- Reliable channels an operator paused (read with the stored depths on a timer).
SELECT topic, channel FROM dmq_channel_pause;

-- name: pause_channel
INSERT INTO dmq_channel_pause (topic, channel) VALUES (%(topic)s, %(channel)s)
ON CONFLICT DO NOTHING;

-- name: unpause_channel
DELETE FROM dmq_channel_pause WHERE topic = %(topic)s AND channel = %(channel)s;

-- name: empty_channel
-- nsqd's channel empty on a reliable channel: every stored, unacknowledged copy of the
-- channel is dropped (the messages stay for the other channels).
DELETE FROM dmq_delivery WHERE topic = %(topic)s AND channel = %(channel)s;

-- ---------------------------------------------------------------------------
-- The message trace, peeking, and the gauges /metrics reads on a timer (schema version 6)
-- ---------------------------------------------------------------------------

-- name: record_returns
-- Deliveries that came back unacknowledged (batched; reliable/trace.py).
INSERT INTO dmq_trace (message_id, topic, channel, attempt, reason, consumer, node_id,
                       delivered_at, returned_at)
SELECT u.message_id, u.topic, u.channel, u.attempt, u.reason, u.consumer, %(node_id)s,
       to_timestamp(u.delivered_ms / 1000.0), to_timestamp(u.returned_ms / 1000.0)
FROM unnest(%(message_ids)b::bigint[], %(topics)b::text[], %(channels)b::text[],
            %(attempts)b::integer[], %(reasons)b::text[], %(consumers)b::text[],
            %(delivered_ms)b::bigint[], %(returned_ms)b::bigint[])
     AS u(message_id, topic, channel, attempt, reason, consumer, delivered_ms, returned_ms);

-- name: sweep_trace
-- Drop returns older than the trace retention (bounded batch).
DELETE FROM dmq_trace
WHERE id IN (SELECT id FROM dmq_trace
             WHERE returned_at < now() - make_interval(secs => %(retention_s)s)
             ORDER BY returned_at LIMIT %(limit)s);

-- name: trace_stored
-- The stored message (or its copy kept for the archive after the sweep), body cut short.
SELECT id, topic, producer, session_id,
       (extract(epoch FROM produced_at) * 1000)::bigint,
       (extract(epoch FROM published_at) * 1000)::bigint,
       node_id, length(body), substring(body FOR %(preview)s), false AS swept
FROM dmq_message WHERE id = %(id)s
UNION ALL
SELECT id, topic, producer, session_id,
       (extract(epoch FROM produced_at) * 1000)::bigint,
       (extract(epoch FROM published_at) * 1000)::bigint,
       node_id, length(body), substring(body FOR %(preview)s), true
FROM dmq_message_history WHERE id = %(id)s;

-- name: trace_pending
-- The message's copies not yet acknowledged: one exact lookup per registered channel.
SELECT d.channel, d.attempts, d.owner
FROM dmq_channel c
JOIN dmq_delivery d ON d.topic = c.topic AND d.channel = c.name AND d.message_id = %(id)s
WHERE c.topic = %(topic)s
ORDER BY d.channel;

-- name: trace_returns
-- Deliveries of the message that came back unacknowledged.
SELECT channel, attempt, reason, consumer, node_id,
       (extract(epoch FROM delivered_at) * 1000)::bigint,
       (extract(epoch FROM returned_at) * 1000)::bigint
FROM dmq_trace WHERE message_id = %(id)s ORDER BY returned_at, id;

-- name: trace_acks
-- The message's acknowledged copies.
SELECT topic, channel, attempts, consumer,
       (extract(epoch FROM published_at) * 1000)::bigint,
       (extract(epoch FROM first_delivered_at) * 1000)::bigint,
       (extract(epoch FROM delivered_at) * 1000)::bigint,
       (extract(epoch FROM acked_at) * 1000)::bigint
FROM dmq_delivery_log WHERE message_id = %(id)s ORDER BY acked_at, id;

-- name: trace_dead_letters
-- Dead letters made of the message's copies, and the one it replays (a replay is stored by
-- producer dmq-replay with the dead letter's id as its session id).
SELECT id, reason, detail, topic, channel, attempts,
       (extract(epoch FROM dead_at) * 1000)::bigint,
       (extract(epoch FROM replayed_at) * 1000)::bigint,
       replay_message_id, message_id
FROM dmq_dead_letter
WHERE message_id = %(id)s OR id = %(replay_of)s
ORDER BY id;

-- name: trace_delayed
-- A delay entry (a DELAY send's id names its entry until it falls due).
SELECT id, topic, channel, producer, session_id, due_ms, fragment, node_id,
       (extract(epoch FROM created_at) * 1000)::bigint, length(body),
       substring(body FOR %(preview)s), replay_of
FROM dmq_delay WHERE id = %(id)s;

-- name: find_message_by_session
-- A stored message's id from its producer and session id.
SELECT id FROM dmq_message WHERE producer = %(producer)s AND session_id = %(session_id)s
UNION ALL
SELECT id FROM dmq_message_history WHERE producer = %(producer)s AND session_id = %(session_id)s
LIMIT 1;

-- name: peek_channel
-- A channel's stored, unacknowledged copies in id order, bodies cut short; nothing changes.
SELECT d.message_id, d.attempts, d.owner, m.producer, m.session_id,
       (extract(epoch FROM m.published_at) * 1000)::bigint,
       length(m.body), substring(m.body FOR %(preview)s)
FROM dmq_delivery d JOIN dmq_message m ON m.id = d.message_id
WHERE d.topic = %(topic)s AND d.channel = %(channel)s AND d.message_id > %(after)s
ORDER BY d.message_id
LIMIT %(limit)s;

-- name: oldest_unacked
-- Per registered channel, the publish time of its lowest unacknowledged message id (one
-- index probe each): the oldest unacknowledged message's age for /metrics.
SELECT c.topic, c.name,
       (SELECT (extract(epoch FROM m.published_at) * 1000)::bigint
        FROM dmq_delivery d JOIN dmq_message m ON m.id = d.message_id
        WHERE d.topic = c.topic AND d.channel = c.name
        ORDER BY d.message_id LIMIT 1)
FROM dmq_channel c ORDER BY c.topic, c.name;

-- name: delay_pending_by_topic
-- Delayed messages waiting, per topic, and the next due time.
SELECT topic, count(*), min(due_ms) FROM dmq_delay GROUP BY topic ORDER BY topic;

-- name: delay_due_histogram
-- Waiting delayed messages by due time: counts per bucket of %(width_ms)s from now.
SELECT greatest(0, (due_ms - %(now_ms)s) / %(width_ms)s)::bigint AS bucket, count(*)
FROM dmq_delay
WHERE (%(topic)s::text IS NULL OR topic = %(topic)s)
GROUP BY 1 ORDER BY 1;

-- name: list_delayed
-- Waiting delayed messages by due time (keyset on (due_ms, id)), bodies cut short.
SELECT id, topic, channel, producer, session_id, due_ms, fragment, length(body),
       substring(body FOR %(preview)s), replay_of
FROM dmq_delay
WHERE (%(topic)s::text IS NULL OR topic = %(topic)s)
  AND (due_ms, id) > (%(after_due)s, %(after_id)s)
ORDER BY due_ms, id
LIMIT %(limit)s;

-- name: deliver_delayed_now
-- Make delay entries due at once (the delay workers move them at their next poll).
UPDATE dmq_delay SET due_ms = %(now_ms)s WHERE id = ANY(%(ids)s::bigint[]) AND due_ms > %(now_ms)s
RETURNING id;

-- name: cancel_delayed
-- Delete delay entries before they fall due.
DELETE FROM dmq_delay WHERE id = ANY(%(ids)s::bigint[]) RETURNING id;

-- name: list_admin_log
-- The admin audit log, newest first.
SELECT id, (extract(epoch FROM at) * 1000)::bigint, surface, actor, operation, filters, affected
FROM dmq_admin_log WHERE id < %(before)s ORDER BY id DESC LIMIT %(limit)s;
