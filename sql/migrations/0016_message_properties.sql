-- dmq schema, version 16: a message's properties (key, priority, headers) are stored with it.
--
-- A send may carry a key (1 to 255 bytes of text), a priority (0 to 9, higher first) and
-- up to 32 headers (dmq_client.wire.properties holds the rules; the server checks them
-- before a send joins a batch, so no value here fails a batch). They are kept wherever
-- the message's body is kept: the stored message, its history for the archive, a delayed
-- message until it falls due, and a dead letter, so a replay delivers the message as it
-- was sent.
--
-- * key: NULL for a message without one (every message of an older client, and every
--   NSQ publish).
-- * priority: 0 when not given, what a message of an older client means.
-- * headers: a JSON object of names to texts, NULL for none (not an empty object: one
--   spelling for "no headers").
--
-- Each is an ADD COLUMN with a constant default: PostgreSQL records it in the catalog and
-- rewrites no row, so the migration takes its locks for milliseconds whatever the table
-- holds. The group commit sends the three arrays only for a batch that holds a message
-- with properties (db.messages): a batch without any stores exactly as before.
ALTER TABLE dmq_message ADD COLUMN key text, ADD COLUMN priority smallint NOT NULL DEFAULT 0,
    ADD COLUMN headers jsonb;
ALTER TABLE dmq_message_history ADD COLUMN key text, ADD COLUMN priority smallint NOT NULL DEFAULT 0,
    ADD COLUMN headers jsonb;
ALTER TABLE dmq_delay ADD COLUMN key text, ADD COLUMN priority smallint NOT NULL DEFAULT 0,
    ADD COLUMN headers jsonb;
ALTER TABLE dmq_dead_letter ADD COLUMN key text, ADD COLUMN priority smallint NOT NULL DEFAULT 0,
    ADD COLUMN headers jsonb;

-- The sweep keeps the properties in the history too (the archive's columns).
CREATE FUNCTION dmq_keep_message_history_v2() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM dmq_archive_state) THEN
        INSERT INTO dmq_message_history
            (id, topic, producer, session_id, produced_at, published_at, node_id, body, key, priority, headers)
        SELECT id, topic, producer, session_id, produced_at, published_at, node_id, body, key, priority, headers
        FROM swept
        ON CONFLICT (id) DO NOTHING;
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER dmq_message_keep_history ON dmq_message;
CREATE TRIGGER dmq_message_keep_history
    AFTER DELETE ON dmq_message
    REFERENCING OLD TABLE AS swept
    FOR EACH STATEMENT EXECUTE FUNCTION dmq_keep_message_history_v2();
DROP FUNCTION dmq_keep_message_history_v1();
