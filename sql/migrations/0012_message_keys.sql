-- dmq schema, version 12: dmq_message's two secondary indexes lead with fixed-width keys.
--
-- Every stored message inserts one entry into each index of dmq_message, inside the send
-- statement, on the publish path. A B-tree insert compares its key with a dozen entries on
-- the way down, and in an index whose first column is text every later column of an entry
-- is found by walking the entry (PostgreSQL caches a column's offset only up to the first
-- variable-width column). bench/pg_cost.py (session 26, valgrind's count of the backend's
-- instructions, 200,000 messages stored) measured the send statement at 58,200 instructions
-- a message, of which the (topic, owner, id) index took about 12,000 and the
-- (producer, session_id) key about 3,000 more than it does in the order (session_id,
-- producer).
--
-- * The resend key becomes (session_id, producer): the same uniqueness (ON CONFLICT
--   (producer, session_id) finds it, since inference does not depend on the column order),
--   and the number decides most comparisons before the text is looked at.
-- * The placement index, which loads a channel's copies of one owner in id order, becomes
--   (hashtext(topic), owner, id): three fixed-width keys. A statement that reads a topic's
--   messages through it says hashtext(m.topic) = hashtext(<topic>) next to m.topic =
--   <topic> (two topics with one hash only cost a filtered entry);
--   tests/integration/test_message_keys.py plans each one with the index. hashtext is
--   PostgreSQL's own immutable hash of text (hash indexes use it too).
-- * dmq_pending, the view of waiting copies, joins with the same condition.
--
-- Both indexes are built here, in the migration's transaction: writes to dmq_message wait
-- until it commits.
ALTER TABLE dmq_message DROP CONSTRAINT dmq_message_producer_session_id_key;
ALTER TABLE dmq_message ADD CONSTRAINT dmq_message_session_producer_key UNIQUE (session_id, producer);
DROP INDEX dmq_message_owner_idx;
CREATE INDEX dmq_message_topic_owner_idx ON dmq_message (hashtext(topic), owner, id);

CREATE OR REPLACE VIEW dmq_pending AS
SELECT c.topic, c.name AS channel, m.id AS message_id, coalesce(a.attempts, 0) AS attempts,
       o.id AS owner, coalesce(k.holder, o.node_id) AS holder
FROM dmq_channel c
CROSS JOIN dmq_owner o
LEFT JOIN dmq_cursor k ON k.topic = c.topic AND k.channel = c.name AND k.owner = o.id
JOIN dmq_message m ON hashtext(m.topic) = hashtext(c.topic) AND m.topic = c.topic AND m.owner = o.id
                  AND m.id > greatest(c.start_id, coalesce(k.floor, c.start_id))
                  AND (m.channel IS NULL OR m.channel = c.name)
LEFT JOIN dmq_attempts a ON a.topic = c.topic AND a.channel = c.name AND a.message_id = m.id
WHERE NOT coalesce(k.done @> m.id, false);
