-- dmq schema, version 20: a reliable topic may keep its acknowledged messages for a time of
-- its own (issue 46: replay from the store, `dmq channel seek`).
--
-- `dmq topic create NAME --retention 7d` (or `dmq topic update NAME --retention 7d|none`): the
-- retention sweep removes a message of the topic once every channel is done with it and it was
-- published longer ago than this; NULL: the server's --message-retention, as before. In a
-- cluster ZooKeeper's topic znode holds it and every node mirrors it here (registry.model
-- TopicSpec.retention_ms).
--
-- An ADD COLUMN with no default rewrites no row.
ALTER TABLE dmq_topic ADD COLUMN retention_ms bigint CHECK (retention_ms > 0);

-- What the retention sweep removed of each topic: the highest id and the newest publish time
-- (ms since the epoch) it deleted (queries.sql note_swept). Nothing the topic still holds was
-- published at or before `swept_ms`: how far back a channel can be sought.
CREATE TABLE dmq_retention (
    topic text PRIMARY KEY,
    swept_id bigint NOT NULL,
    swept_ms bigint NOT NULL
);
