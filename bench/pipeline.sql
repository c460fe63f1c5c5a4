-- Fill and ceiling queries for bench/pipeline.py (synthetic history, shaped as the server writes it).

-- name: fill_owner
-- The incarnation that "stored" the synthetic messages (retired: a server started later
-- delivers what is left of them).
INSERT INTO dmq_owner (id, node_id, retired_at) VALUES (1, 'bench:4150', now())
ON CONFLICT (id) DO NOTHING;

-- name: fill_messages
-- Messages 1..n, one every `spacing_ms` from `start`; every fourth to topic audit, the rest to orders.
INSERT INTO dmq_message (id, topic, producer, session_id, produced_at, published_at, node_id, owner, body)
SELECT g, CASE WHEN g %% 4 = 0 THEN 'audit' ELSE 'orders' END, 'bench-producer', g,
       t - interval '1 millisecond', t, 'bench:4150', 1,
       convert_to(repeat(md5(g::text), 4), 'UTF8')
FROM generate_series(1, %(messages)s) AS g,
     LATERAL (SELECT %(start)s::timestamptz + (g - 1) * %(spacing_ms)s * interval '1 millisecond') AS x(t);

-- name: fill_log
-- One fact per message and channel, until `rows`: mostly quick, some redelivered; stored as
-- the server stores them since schema version 10, in acknowledgement batches (of 100 here).
WITH facts AS (
    SELECT (row_number() OVER (ORDER BY m.id, c.name) - 1) / 100 AS g,
           row_number() OVER (ORDER BY m.id, c.name) AS n, m.id, m.topic, c.name AS channel,
           (extract(epoch FROM m.published_at) * 1000)::bigint AS published_ms,
           2 + (m.id * 7 + length(c.name)) %% 40
             + CASE WHEN m.id %% 100 = 0 THEN 5000 ELSE 0 END
             + CASE WHEN m.id %% 1000 = 0 THEN 60000 ELSE 0 END AS ack_delay_ms,
           1 + (m.id %% 100 = 0)::int + (m.id %% 1000 = 0)::int AS attempts
    FROM dmq_message m JOIN dmq_channel c ON c.topic = m.topic
    ORDER BY m.id, c.name
    LIMIT %(rows)s
), batches AS (
    SELECT g, max(published_ms + ack_delay_ms) AS last_ms, min(id) AS low_id, max(id) AS high_id,
           array_agg(topic ORDER BY n) AS topics, array_agg(channel ORDER BY n) AS channels,
           array_agg(id ORDER BY n) AS message_ids, array_agg(published_ms ORDER BY n) AS published_ms,
           array_agg(published_ms + 1 ORDER BY n) AS first_ms,
           array_agg(published_ms + ack_delay_ms ORDER BY n) AS acked_ms,
           array_agg(attempts ORDER BY n) AS attempts, array_agg(NULL::text ORDER BY n) AS consumers,
           array_agg(0::bigint ORDER BY n) AS delivered_ms
    FROM facts GROUP BY g
), numbered AS (
    SELECT nextval('dmq_delivery_batch_id_seq') AS id, b.*
    FROM (SELECT * FROM batches ORDER BY g) AS b
)
INSERT INTO dmq_delivery_batch (id, first_fact, acked_at, low_id, high_id, topics, channels, message_ids,
                                published_ms, first_ms, acked_ms, attempts, consumers, delivered_ms)
SELECT id, id << 20, to_timestamp(last_ms / 1000.0), low_id, high_id, topics, channels, message_ids,
       published_ms, first_ms, acked_ms, attempts, consumers, delivered_ms
FROM numbered;

-- name: fill_pending
-- Every channel is done with every message but the newest billing copies (backlog): the
-- cursors of the one owner.
INSERT INTO dmq_cursor (topic, channel, owner, holder, floor)
SELECT c.topic, c.name, 1, 'bench:4150',
       CASE WHEN (c.topic, c.name) = ('orders', 'billing') THEN %(messages)s - %(pending)s ELSE %(messages)s END
FROM dmq_channel c
ON CONFLICT (topic, channel, owner) DO UPDATE SET floor = EXCLUDED.floor;

-- name: fill_dead_letters
-- Dead letters with a mix of reasons.
INSERT INTO dmq_dead_letter (reason, topic, channel, producer, session_id, attempts, body, published_at, dead_at)
SELECT (ARRAY['max_attempts', 'expired', 'rate_limited'])[1 + g %% 3], 'orders',
       CASE WHEN g %% 3 = 2 THEN NULL ELSE 'billing' END, 'bench-producer', g, 3, 'dead'::bytea,
       %(start)s::timestamptz + g * interval '1 second', %(start)s::timestamptz + g * interval '1 second'
FROM generate_series(1, %(dead)s) AS g;

-- name: analyze
-- Fresh statistics after the fill.
ANALYZE;

-- name: copy_out
-- The ceiling: the archive's rows exported by COPY (dbtable: the archive's JDBC query).
COPY (SELECT * FROM {dbtable}) TO STDOUT (FORMAT {format});

-- name: log_count
-- Delivery-log rows.
SELECT count(*), min(published_at), max(acked_at) FROM dmq_delivery_log;
