-- dmq schema, version 21: a channel can be sought (issue 46: `dmq channel seek`), and what a
-- seek rewinds must not be undone by an acknowledgement made before it.
--
-- A seek writes a channel's cursors anew (every stored message of the topic from the target
-- on becomes the channel's to deliver again) and raises the channel's `epoch`; each cursor
-- it writes takes that epoch. A node proposes its acknowledgements with the epoch of the
-- channel it knew when it pushed the copies; `ack_deliveries` moves a cursor only with a
-- proposal of its epoch or a later one, tested on the row as locked, so a seek and an ack
-- are ordered either way. A node whose acks are refused so learns of the seek and reads the
-- channel again from its new cursors.
--
-- 0 for every channel and cursor there is. ADD COLUMN with a constant default rewrites no row.
ALTER TABLE dmq_channel ADD COLUMN epoch bigint NOT NULL DEFAULT 0;
ALTER TABLE dmq_cursor ADD COLUMN epoch bigint NOT NULL DEFAULT 0;
