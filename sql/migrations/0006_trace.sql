-- dmq schema, version 6: the message trace (what happened to one message, as stored facts).
--
-- A message's life is mostly in tables that exist already: dmq_message (stored: when, by
-- which node, producer and session id), dmq_delivery (copies not yet acknowledged, their
-- attempts and owner), dmq_delivery_log (each acknowledged copy) and dmq_dead_letter. What
-- was missing: who held a copy, and every delivery that did not end in an ack.
--
-- * dmq_delivery_log gains the consumer that acknowledged the copy and when that (last)
--   delivery was pushed: two values in the ack batch the server writes anyway.
-- * dmq_trace keeps each delivery that came back unacknowledged, and why (the message
--   timeout passed, the consumer went away, the consumer gave it back with REQ). Only
--   redeliveries write here, in batches off the ack path, so a message delivered once and
--   acknowledged costs nothing more. Rows older than --trace-retention are swept.
--
-- Looking one message up must not scan: a BRIN index on the log's message ids (ids grow
-- with time, and the log is appended in roughly that order, so a summary per block range
-- finds the rows at almost no cost to each insert), and plain indexes on the two small
-- tables.
ALTER TABLE dmq_delivery_log
    ADD COLUMN consumer text,                                -- NULL: logged before version 6
    ADD COLUMN delivered_at timestamptz;                     -- the acknowledged delivery's push
CREATE INDEX dmq_delivery_log_message_brin ON dmq_delivery_log USING brin (message_id);

CREATE TABLE dmq_trace (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id    bigint NOT NULL,
    topic         text NOT NULL,
    channel       text NOT NULL,
    attempt       integer NOT NULL,                          -- the delivery that came back
    reason        text NOT NULL CHECK (reason IN ('timeout', 'consumer_gone', 'requeued')),
    consumer      text NOT NULL DEFAULT '',
    node_id       text NOT NULL DEFAULT '',                  -- node that delivered it
    delivered_at  timestamptz NOT NULL,
    returned_at   timestamptz NOT NULL
);
CREATE INDEX dmq_trace_message_idx ON dmq_trace (message_id);
CREATE INDEX dmq_trace_returned_idx ON dmq_trace (returned_at);

CREATE INDEX dmq_dead_letter_message_idx ON dmq_dead_letter (message_id) WHERE message_id IS NOT NULL;
