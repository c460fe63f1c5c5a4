-- dmq schema, version 2: bookkeeping for the data pipeline (dmq_pipeline).
--
-- The archive copies delivery-log rows and the messages they refer to into
-- Parquet, then trims the log. The server sweeps a fully acknowledged message
-- out of dmq_message after --message-retention, and a message that waited in
-- a backlog longer than that is swept right after its last acknowledgement,
-- so no retention setting guarantees the archive still finds it. Instead,
-- while archiving is enabled, a statement trigger keeps every swept message
-- in dmq_message_history until the archive has copied the log rows that refer
-- to it. A message therefore lives in exactly one of dmq_message and
-- dmq_message_history (the move happens in the sweeping transaction).

-- Present (one row) once `dmq-pipeline archive` has run: archiving is enabled
-- and its Parquet lives at `location`.
CREATE TABLE dmq_archive_state (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    location    text NOT NULL,
    enabled_at  timestamptz NOT NULL DEFAULT now()
);

-- One row per archive batch: the delivery-log ids (low_id, high_id].
-- planned -> written (Parquet committed, `rows` counted) -> trimmed (log rows
-- deleted). The watermark is max(high_id); at most one batch is unfinished,
-- and the next run finishes it before planning another.
CREATE TABLE dmq_archive_batch (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    low_id        bigint NOT NULL,
    high_id       bigint NOT NULL CHECK (high_id > low_id),
    state         text NOT NULL DEFAULT 'planned' CHECK (state IN ('planned', 'written', 'trimmed')),
    planned_rows  bigint NOT NULL,
    rows          bigint,
    missing_messages bigint,
    planned_at    timestamptz NOT NULL DEFAULT now(),
    written_at    timestamptz,
    trimmed_at    timestamptz
);
CREATE UNIQUE INDEX dmq_archive_batch_unfinished_idx ON dmq_archive_batch ((true))
    WHERE state <> 'trimmed';

-- Swept messages kept for the archive (same columns as dmq_message).
CREATE TABLE dmq_message_history (
    id            bigint PRIMARY KEY,
    topic         text NOT NULL,
    producer      text NOT NULL,
    session_id    bigint NOT NULL,
    produced_at   timestamptz,
    published_at  timestamptz NOT NULL,
    node_id       text NOT NULL,
    body          bytea NOT NULL,
    swept_at      timestamptz NOT NULL DEFAULT now()
);

-- One INSERT ... SELECT per sweeping statement, not one per row; does nothing
-- until archiving is enabled.
CREATE FUNCTION dmq_keep_message_history_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM dmq_archive_state) THEN
        INSERT INTO dmq_message_history
            (id, topic, producer, session_id, produced_at, published_at, node_id, body)
        SELECT id, topic, producer, session_id, produced_at, published_at, node_id, body
        FROM swept
        ON CONFLICT (id) DO NOTHING;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER dmq_message_keep_history
    AFTER DELETE ON dmq_message
    REFERENCING OLD TABLE AS swept
    FOR EACH STATEMENT EXECUTE FUNCTION dmq_keep_message_history_v1();

-- Replay selects dead letters not yet replayed.
CREATE INDEX dmq_dead_letter_unreplayed_idx ON dmq_dead_letter (id) WHERE replayed_at IS NULL;
