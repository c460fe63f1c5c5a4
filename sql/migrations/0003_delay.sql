-- dmq schema, version 3: delayed messages and the admin audit log.
--
-- A delayed message (DELAY over the dmq protocol, DPUB or /pub?defer over NSQ to a
-- reliable topic) waits in dmq_delay until due_ms. Delay workers own fragments;
-- each takes its due rows with FOR UPDATE SKIP LOCKED and, in the same
-- transaction, deletes them here and inserts the message and its deliveries, so a
-- due row becomes exactly one message. Replaying a dead letter goes through this
-- table too (due at once, restricted to the dead letter's channel), so replay
-- works from the CLI without a running server and on any node that owns the
-- fragment.
CREATE TABLE dmq_delay (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    fragment     integer NOT NULL CHECK (fragment >= 1),
    due_ms       bigint NOT NULL,                          -- Unix ms when it falls due
    topic        text NOT NULL,
    channel      text,                                     -- NULL: every channel; set: that channel only (replay)
    producer     text NOT NULL,
    session_id   bigint NOT NULL,
    produced_ms  bigint NOT NULL DEFAULT 0,                -- producer's clock, 0 if unknown
    replay_of    bigint,                                   -- dmq_dead_letter.id being replayed
    node_id      text NOT NULL DEFAULT '',                 -- node that stored it
    created_at   timestamptz NOT NULL DEFAULT now(),
    body         bytea NOT NULL,
    UNIQUE (producer, session_id)                          -- resend idempotency, as dmq_message
);
CREATE INDEX dmq_delay_due_idx ON dmq_delay (fragment, due_ms);

-- Every destructive admin operation (dead-letter replay and delete), from any
-- surface (CLI, HTTP admin API, admin console): who, what, how many.
CREATE TABLE dmq_admin_log (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT now(),
    surface     text NOT NULL,                             -- cli | http | console
    actor       text NOT NULL DEFAULT '',                  -- peer address or OS user
    operation   text NOT NULL,                             -- e.g. dlq.replay, dlq.delete
    filters     text NOT NULL DEFAULT '',                  -- the selection, as given
    affected    bigint NOT NULL DEFAULT 0
);

CREATE INDEX dmq_dead_letter_dead_at_idx ON dmq_dead_letter (dead_at);
