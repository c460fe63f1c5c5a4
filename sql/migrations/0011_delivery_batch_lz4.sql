-- dmq schema, version 11: the delivery batches' arrays are compressed with lz4.
--
-- Every ack statement writes one dmq_delivery_batch row whose ten arrays hold a few dozen
-- bytes per acknowledged copy: a batch of a hundred or more is past PostgreSQL's TOAST
-- threshold, so the row is compressed in the acknowledging statement, on the
-- acknowledgement path. The default method, pglz, was most of what the facts cost there:
-- bench/ack_cost.py (session 19, batches of 200, three rounds) measured 3.0 us of
-- PostgreSQL CPU and 12 bytes of WAL per ack with pglz, 2.2 us and 8 bytes with lz4, and
-- 2.5 us and 91 bytes with no compression at all; the cursor alone is 0.5 us.
--
-- Only values written from now on use lz4; rows already stored keep pglz and read back as
-- before (a value records its own method). PostgreSQL 14 and later choose the method per
-- column; a server built without lz4 refuses it, and then the columns keep pglz: the
-- schema is the same, only slower to acknowledge.
DO $$
BEGIN
    ALTER TABLE dmq_delivery_batch
        ALTER COLUMN topics SET COMPRESSION lz4,
        ALTER COLUMN channels SET COMPRESSION lz4,
        ALTER COLUMN message_ids SET COMPRESSION lz4,
        ALTER COLUMN published_ms SET COMPRESSION lz4,
        ALTER COLUMN first_ms SET COMPRESSION lz4,
        ALTER COLUMN acked_ms SET COMPRESSION lz4,
        ALTER COLUMN attempts SET COMPRESSION lz4,
        ALTER COLUMN consumers SET COMPRESSION lz4,
        ALTER COLUMN delivered_ms SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported THEN
    RAISE NOTICE 'this PostgreSQL has no lz4: dmq_delivery_batch keeps pglz';
END
$$;
