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
