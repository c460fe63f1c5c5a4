-- dmq schema, version 10: the delivery log is stored one row per acknowledgement batch.
--
-- Up to version 9 each acknowledged copy was a row of its own, written by the statement
-- that moves the cursor: nearly all that statement cost PostgreSQL (bench/ack_cost.py:
-- 7-17 us of CPU and 200 bytes of WAL per ack, of which the cursor itself is 2-3 us and
-- 2 bytes), so fan-out to N channels still cost N rows. The facts are what the message
-- trace and the data pipeline read, and they must stay exactly as durable and as exact as
-- the cursor they go with, so they stay in the same statement; what changes is their shape.
-- A batch of acknowledgements made durable together is one row of parallel arrays, the
-- arrays the server sends anyway (Pulsar's batched entries, Kafka's record batches): one
-- heap tuple, one index entry and about a tenth of the WAL for a batch of a hundred.
--
-- dmq_delivery_log becomes a view with the old columns, one row per fact as before, so
-- the trace, the pipeline's report and the operators' queries read it as they did. Its
-- extra columns name the batch a fact came in (ack_batch and that batch's newest ack,
-- lowest and highest message id), which is what the queries that must not unnest the
-- whole log filter on: the archive's ranges are batch ids, a time window is the batch's
-- newest ack, a message is found between a batch's lowest and highest id.
--
-- Fact ids. A fact's id is its batch's first_fact plus its place in the batch (from 0).
-- A batch stored from version 10 on has first_fact = id << 20 (so at most 2^20 facts a
-- batch, which the CHECK holds); a row of the old log becomes a batch of one that keeps
-- its id as both its batch id and its fact id. New batch ids start above every id the old
-- log gave out and every archived range, so fact ids keep growing and the archive's
-- watermark (old log ids up to now, batch ids from now on) stays where it was.
--
-- Times are kept as epoch milliseconds, as the server sends them, and turned into
-- timestamps when read, by the expression the old statement used when it wrote them:
-- the view shows the values the old rows held. Old rows are carried over at millisecond
-- precision (the server only ever wrote milliseconds).

CREATE SEQUENCE dmq_delivery_batch_id_seq;

CREATE TABLE dmq_delivery_batch (
    id            bigint PRIMARY KEY DEFAULT nextval('dmq_delivery_batch_id_seq'),
    first_fact    bigint NOT NULL,                -- id of its first fact (see above)
    acked_at      timestamptz NOT NULL,           -- its newest acknowledgement
    low_id        bigint NOT NULL,                -- its lowest and highest message id
    high_id       bigint NOT NULL,
    -- one element per acknowledged copy, in the order they were sent
    topics        text[] NOT NULL,
    channels      text[] NOT NULL,
    message_ids   bigint[] NOT NULL,
    published_ms  bigint[] NOT NULL,
    first_ms      bigint[] NOT NULL,              -- 0: no first delivery recorded
    acked_ms      bigint[] NOT NULL,
    attempts      integer[] NOT NULL,
    consumers     text[] NOT NULL,                -- NULL element: logged before version 6
    delivered_ms  bigint[] NOT NULL,              -- 0: logged before version 6
    CHECK (cardinality(message_ids) BETWEEN 1 AND 1048576)
);
ALTER SEQUENCE dmq_delivery_batch_id_seq OWNED BY dmq_delivery_batch.id;

INSERT INTO dmq_delivery_batch (id, first_fact, acked_at, low_id, high_id, topics, channels, message_ids,
                                published_ms, first_ms, acked_ms, attempts, consumers, delivered_ms)
SELECT id, id, acked_at, message_id, message_id, ARRAY[topic], ARRAY[channel], ARRAY[message_id],
       ARRAY[round(extract(epoch FROM published_at) * 1000)::bigint],
       ARRAY[coalesce(round(extract(epoch FROM first_delivered_at) * 1000)::bigint, 0)],
       ARRAY[round(extract(epoch FROM acked_at) * 1000)::bigint], ARRAY[attempts], ARRAY[consumer],
       ARRAY[coalesce(round(extract(epoch FROM delivered_at) * 1000)::bigint, 0)]
FROM dmq_delivery_log;

-- above every id the old log gave out (rows the archive trimmed included) and every
-- archived range
SELECT setval('dmq_delivery_batch_id_seq', greatest(
    1,
    (SELECT max(id) FROM dmq_delivery_log),
    pg_sequence_last_value(pg_get_serial_sequence('dmq_delivery_log', 'id')::regclass),
    (SELECT max(high_id) FROM dmq_archive_batch)));

DROP TABLE dmq_delivery_log;

-- A time window (the report, the archive's cut-off) and a message (the trace) are found
-- through summaries per block range: batches are appended in acknowledgement order.
CREATE INDEX dmq_delivery_batch_acked_brin ON dmq_delivery_batch USING brin (acked_at);
CREATE INDEX dmq_delivery_batch_ids_brin ON dmq_delivery_batch USING brin (low_id, high_id);

CREATE VIEW dmq_delivery_log AS
SELECT b.first_fact + f.n - 1 AS id, f.message_id, f.topic, f.channel,
       to_timestamp(f.published_ms / 1000.0) AS published_at,
       CASE WHEN f.first_ms > 0 THEN to_timestamp(f.first_ms / 1000.0) END AS first_delivered_at,
       to_timestamp(f.acked_ms / 1000.0) AS acked_at, f.attempts, f.consumer,
       CASE WHEN f.delivered_ms > 0 THEN to_timestamp(f.delivered_ms / 1000.0) END AS delivered_at,
       b.id AS ack_batch, b.acked_at AS ack_batch_at, b.low_id AS ack_batch_low, b.high_id AS ack_batch_high
FROM dmq_delivery_batch b
CROSS JOIN LATERAL unnest(b.message_ids, b.topics, b.channels, b.published_ms, b.first_ms, b.acked_ms,
                          b.attempts, b.consumers, b.delivered_ms)
     WITH ORDINALITY AS f(message_id, topic, channel, published_ms, first_ms, acked_ms, attempts,
                          consumer, delivered_ms, n);
