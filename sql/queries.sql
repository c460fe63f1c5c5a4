-- name: create_schema_version
-- The migration ledger; created before any migration runs.
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
WITH input AS (
    SELECT * FROM unnest(%(topics)b::text[], %(producers)b::text[], %(session_ids)b::bigint[],
                         %(produced_ms)b::bigint[], %(bodies)b::bytea[])
             WITH ORDINALITY AS u(topic, producer, session_id, produced_ms, body, ord)
), ins AS (
    INSERT INTO dmq_message (topic, producer, session_id, produced_at, node_id, body)
    SELECT topic, producer, session_id,
           CASE WHEN produced_ms > 0 THEN to_timestamp(produced_ms / 1000.0) END,
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
-- Make a batch of acknowledgements durable: drop the delivery rows, log them.
WITH input AS (
    SELECT * FROM unnest(%(topics)b::text[], %(channels)b::text[], %(message_ids)b::bigint[],
                         %(first_ms)b::bigint[], %(acked_ms)b::bigint[], %(attempts)b::integer[])
             AS u(topic, channel, message_id, first_ms, acked_ms, attempts)
), acked AS (
    DELETE FROM dmq_delivery d USING input u
    WHERE d.topic = u.topic AND d.channel = u.channel AND d.message_id = u.message_id
    RETURNING d.message_id, d.topic, d.channel, u.first_ms, u.acked_ms,
              greatest(u.attempts, d.attempts) AS attempts
)
INSERT INTO dmq_delivery_log (message_id, topic, channel, published_at, first_delivered_at,
                              acked_at, attempts)
SELECT a.message_id, a.topic, a.channel, m.published_at,
       CASE WHEN a.first_ms > 0 THEN to_timestamp(a.first_ms / 1000.0) END,
       to_timestamp(a.acked_ms / 1000.0), a.attempts
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
