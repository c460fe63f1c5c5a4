-- dmq schema, version 19: a topic's row carries the version of the registry it was copied
-- from, and only a newer version may replace it (issue 45 §2, `dmq topic move` of an
-- ordered topic).
--
-- Every cluster's database holds a copy of every topic's row, because the group commit
-- checks a topic's placement there (insert_messages refuses a topic placed elsewhere: the
-- move's fence). Each node writes those copies from its own read of the registry
-- (ZooKeeper, or the main cluster's tables). A node whose read predates a move, or that
-- cannot read ZooKeeper and keeps its last view, used to write the old placement back over
-- the fence, and a message of an ordered topic could then be stored on the old cluster after
-- the next message of its key was stored on the new one. With the version, the copy of
-- the registry a node writes replaces a row only if it is at least as new
-- (upsert_topic), so once the fence is in, nothing older undoes it.
--
-- The version is a pair, compared in order. With ZooKeeper: the registry's own epoch, the
-- creation time (ms) of its /dmq/topic znode, so that a ZooKeeper rebuilt from scratch and
-- seeded again, whose transaction ids start again from 0, is newer than the one it replaces;
-- then the topic znode's mzxid (the transaction id of its last change: it only grows within
-- an ensemble, and a topic created again is newer than the one deleted). Without ZooKeeper:
-- epoch 0 (older than any ZooKeeper's), and a counter the main cluster's registry statements
-- raise from this sequence. (0, 0) for every row there is: the first copy written replaces it.
-- ADD COLUMNs with constant defaults rewrite no row.
ALTER TABLE dmq_topic ADD COLUMN registry_epoch bigint NOT NULL DEFAULT 0,
                      ADD COLUMN version bigint NOT NULL DEFAULT 0;
CREATE SEQUENCE dmq_topic_version;
