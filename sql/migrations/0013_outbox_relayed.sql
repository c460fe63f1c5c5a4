-- dmq schema, version 13: what the outbox relays stored, checked in the commit that stores it.
--
-- A relay (dmq_server/protocols/outbox_relay.py) reads committed rows from an outbox in an
-- application's database, stores them here, then deletes them there. The two databases
-- commit apart, so a relay that dies after the store and before the delete reads the same
-- rows again. The resend key of dmq_message, (producer, session_id), answers such a repeat
-- only while the message is still stored: after an outage longer than --message-retention
-- the sweep may have deleted it, and the repeat would be stored as a new message. So every
-- outbox row stored records its (producer, session_id) in dmq_outbox_relayed, in the same
-- statement and commit (the triggers below), and a row already recorded is not stored
-- again, however long ago it was. The relay deletes a record once the outbox row's delete
-- has committed in the application's database (it can never be read again then).
--
-- Producers (dmq_server/core/outbox_rows.py): 'outbox:NAME' with the row's id as its
-- session id, 'outbox:NAME:own' with the application's own session id (two producers, so
-- an own id never meets a row id), each with ':delayed' after it for a delayed message.
-- A delayed message is recorded when it enters dmq_delay; its move into dmq_message later
-- (move_due) is not a relay and is not checked again, hence the message trigger's
-- condition. The WHEN conditions are what all other sends pay: a LIKE on the producer's
-- first bytes (a byte compare) per row, no function call. bench/pg_cost.py (batches of 200,
-- session of issue 44): the send statement 47,482 -> 47,880 PostgreSQL instructions a
-- message (a trigger whose WHEN is false costs 47,746; starts_with() instead of LIKE, which
-- looks up the collation each row, cost 48,684).
CREATE TABLE dmq_outbox_relayed (
    session_id  bigint NOT NULL,
    producer    text NOT NULL,
    relayed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (session_id, producer)
);

-- Record the row's pair; skip the row (RETURN NULL) when it was recorded before. Inside
-- the storing statement, so the record and the message commit or roll back together.
CREATE FUNCTION dmq_outbox_relayed_once() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO dmq_outbox_relayed (session_id, producer) VALUES (NEW.session_id, NEW.producer)
    ON CONFLICT (session_id, producer) DO NOTHING;
    IF FOUND THEN
        RETURN NEW;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER dmq_message_outbox_once BEFORE INSERT ON dmq_message
    FOR EACH ROW WHEN (NEW.producer LIKE 'outbox:%' AND NEW.producer NOT LIKE '%:delayed')
    EXECUTE FUNCTION dmq_outbox_relayed_once();

CREATE TRIGGER dmq_delay_outbox_once BEFORE INSERT ON dmq_delay
    FOR EACH ROW WHEN (NEW.producer LIKE 'outbox:%')
    EXECUTE FUNCTION dmq_outbox_relayed_once();
