-- The outbox relay's statements in dmq's OWN database (dmq_server.db.outbox_ledger):
-- dmq_outbox_relayed, the record of the outbox rows stored (schema version 13), and the
-- dead letters of rows that cannot be stored. Not in sql/queries.sql: the group commit
-- never runs these; the relay does, on its own connection, in autocommit.

-- name: relayed_before
-- Which of these (producer, session_id) pairs were stored (or dead-lettered) before. This
-- and forget_relayed take a batch's pairs as binary arrays (dmq_server.db.arrays).
SELECT r.producer, r.session_id
FROM dmq_outbox_relayed r
JOIN unnest(%(producers)b::text[], %(session_ids)b::bigint[]) AS u(producer, session_id)
  ON r.session_id = u.session_id AND r.producer = u.producer;

-- name: dead_letter_rows
-- Rows that cannot be stored (an unknown topic, a body over --max-msg-size, ...) become
-- dead letters with the reason, recorded as relayed in the same statement: a row already
-- recorded is skipped, so a relay that dies before its delete records each once.
WITH input AS (
    SELECT * FROM unnest(%(topics)s::text[], %(producers)s::text[], %(session_ids)s::bigint[],
                         %(bodies)s::bytea[], %(details)s::text[], %(produced_ms)s::bigint[])
             AS u(topic, producer, session_id, body, detail, produced_ms)
), claimed AS (
    INSERT INTO dmq_outbox_relayed (session_id, producer)
    SELECT session_id, producer FROM input
    ON CONFLICT (session_id, producer) DO NOTHING
    RETURNING session_id, producer
)
INSERT INTO dmq_dead_letter (reason, detail, topic, producer, session_id, body, published_at)
SELECT 'client_reported', i.detail, i.topic, i.producer, i.session_id, i.body,
       timestamptz 'epoch' + i.produced_ms * interval '1 millisecond'
FROM input i JOIN claimed c ON c.session_id = i.session_id AND c.producer = i.producer
RETURNING id;

-- name: forget_relayed
-- The records of rows whose delete committed in the application's database.
DELETE FROM dmq_outbox_relayed r
USING unnest(%(producers)b::text[], %(session_ids)b::bigint[]) AS u(producer, session_id)
WHERE r.session_id = u.session_id AND r.producer = u.producer;

-- name: recorded_rows
-- The records of an outbox whose session id is its row's id (the relay's own numbering),
-- so a relay taking over can drop those of rows no longer in the outbox (a relay that died
-- between its delete and forget_relayed leaves them).
SELECT producer, session_id FROM dmq_outbox_relayed
WHERE producer = ANY(%(producers)s::text[])
ORDER BY session_id
LIMIT %(limit)s;
