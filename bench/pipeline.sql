-- Fill and ceiling queries for bench/pipeline.py (synthetic history, shaped as the server writes it).

-- name: fill_messages
-- Messages 1..n, one every `spacing_ms` from `start`; every fourth to topic audit, the rest to orders.
INSERT INTO dmq_message (id, topic, producer, session_id, produced_at, published_at, node_id, body)
SELECT g, CASE WHEN g %% 4 = 0 THEN 'audit' ELSE 'orders' END, 'bench-producer', g,
       t - interval '1 millisecond', t, 'bench:4150',
       convert_to(repeat(md5(g::text), 4), 'UTF8')
FROM generate_series(1, %(messages)s) AS g,
     LATERAL (SELECT %(start)s::timestamptz + (g - 1) * %(spacing_ms)s * interval '1 millisecond') AS x(t);

-- name: fill_log
-- One log row per message and channel, until `rows`: mostly quick, some redelivered.
INSERT INTO dmq_delivery_log (message_id, topic, channel, published_at, first_delivered_at,
                              acked_at, attempts)
SELECT m.id, m.topic, c.name, m.published_at, m.published_at + interval '1 millisecond',
       m.published_at + (2 + (m.id * 7 + length(c.name)) %% 40
                         + CASE WHEN m.id %% 100 = 0 THEN 5000 ELSE 0 END
                         + CASE WHEN m.id %% 1000 = 0 THEN 60000 ELSE 0 END) * interval '1 millisecond',
       1 + (m.id %% 100 = 0)::int + (m.id %% 1000 = 0)::int
FROM dmq_message m JOIN dmq_channel c ON c.topic = m.topic
ORDER BY m.id, c.name
LIMIT %(rows)s;

-- name: fill_pending
-- The newest messages' billing copies are still waiting (backlog).
INSERT INTO dmq_delivery (topic, channel, message_id, attempts)
SELECT 'orders', 'billing', id, 1 FROM dmq_message
WHERE topic = 'orders' AND id > %(messages)s - %(pending)s;

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
