-- dmq schema, version 9: the delivery log's time index costs the acknowledgement less.
--
-- Every acknowledgement appends a row to dmq_delivery_log in the same statement that moves
-- the cursor, and that row is nearly all the statement costs. Its B-tree on acked_at added
-- a quarter of the WAL each ack writes (267 bytes per ack with it, 200-218 without, in
-- bench/ack_cost.py: WAL that every commit flushes and a synchronous standby receives) and
-- about 1 us of PostgreSQL CPU. The log is appended in acknowledgement order, so acked_at
-- follows the physical order of the rows and a BRIN index (a summary per block range)
-- finds a time window for the report's range scans as the B-tree did, at almost no cost
-- per insert: the same reasoning as the message-id BRIN of version 6.
-- Rows the archive deletes leave space that later rows reuse; their block ranges then
-- span older and newer times and are read for both, which costs the report a little, not
-- the acknowledgement.
DROP INDEX IF EXISTS dmq_delivery_log_acked_idx;
CREATE INDEX dmq_delivery_log_acked_brin ON dmq_delivery_log USING brin (acked_at);
