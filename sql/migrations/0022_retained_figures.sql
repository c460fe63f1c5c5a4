-- dmq schema, version 22: how many messages and body bytes each reliable topic keeps
-- (issue 46: /stats, /metrics, the console), without counting millions of rows on a request.
--
-- The retention sweep counts each topic incrementally, under the topic's sweep lock
-- (db.retained.count_topic_steps): `messages` and `bytes` (octet_length of the stored
-- bodies) are exact for the topic's rows with id <= `counted_to`, an id below which no row
-- can still be committed (db.retained.settle_point_steps); every message published before
-- `counted_ms` (ms since the epoch) has such an id. The sweep's delete subtracts exactly
-- the rows it removes at or below `counted_to`, in its own transaction. NULL `counted_ms`:
-- the first count has not reached a settled point yet.
--
-- A table of its own, not columns of dmq_retention: that row says what a seek can reach
-- (swept_id, swept_ms, NOT NULL), and a topic is counted long before anything of it is swept.
CREATE TABLE dmq_retained (
    topic text PRIMARY KEY,
    counted_to bigint NOT NULL DEFAULT 0,
    messages bigint NOT NULL DEFAULT 0,
    bytes bigint NOT NULL DEFAULT 0,
    counted_ms bigint
);
