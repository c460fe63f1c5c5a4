-- dmq outbox, version 1: the outbox, the inbox, send() and the relay's NOTIFY, in the
-- application's own database (`dmq outbox install --dsn APP_DSN`).
--
-- @schema@ stands for the schema chosen at install (default dmq_outbox; the installer
-- allows [a-z_][a-z0-9_]* only, so it needs no quoting) and @channel@ for the NOTIFY
-- channel the relay listens on, the schema's name as a string literal.
--
-- An application role needs USAGE on the schema, EXECUTE on send, INSERT on the outbox
-- and INSERT, SELECT on the inbox, nothing else (docs/client.md, "Transactional
-- messages"): it can add messages and inbox records in its own transactions, and can
-- neither read the outbox, change it nor delete from either table.

-- What the application's transactions send. The relay reads committed rows in id order
-- and removes them once dmq has stored them. The id is an identity column rather than
-- bigserial: inserting into an identity column takes no privilege on its sequence, so
-- INSERT on the table is all a sender needs. txid groups the rows of one transaction (the
-- relay keeps their order); due_ms is a delayed message's due time (ms since the epoch),
-- NULL to deliver at once; session_id is the sender's own id for the message, NULL to let
-- the relay number it; headers are reserved for message headers.
CREATE TABLE @schema@.outbox (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic       text NOT NULL CHECK (topic ~ '^[.a-zA-Z0-9_-]{1,64}(#ephemeral)?$'),
    body        bytea NOT NULL,
    headers     jsonb,
    due_ms      bigint CHECK (due_ms >= 0),
    session_id  bigint CHECK (session_id >= 0),
    created_at  timestamptz NOT NULL DEFAULT now(),
    txid        xid8 NOT NULL DEFAULT pg_current_xact_id()
);

-- What a consumer's transactions have handled: (channel, message id) recorded in the same
-- transaction as the handler's writes, so a redelivery after the commit is recognised.
-- channel is the consumer's key for its subscription (by default "topic/channel", as a
-- channel name alone is not unique across topics); message_id is text so NSQ's 16-byte ids
-- fit as well as dmq's numbers. Rows go by prune_inbox, oldest first (BRIN: they arrive
-- in processed_at order, and the index stays a few pages).
CREATE TABLE @schema@.inbox (
    channel       text NOT NULL,
    message_id    text NOT NULL,
    processed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (channel, message_id)
);
CREATE INDEX inbox_processed_at_idx ON @schema@.inbox USING brin (processed_at);

-- send(topic, body[, delay_ms][, session_id]): one INSERT in the caller's transaction;
-- nothing leaves before it commits. Invoker's rights, so the grants above decide who may.
CREATE FUNCTION @schema@.send(topic text, body bytea, delay_ms bigint DEFAULT NULL,
                              session_id bigint DEFAULT NULL)
RETURNS void LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF delay_ms < 0 THEN
        RAISE EXCEPTION 'dmq outbox send: delay_ms must be 0 or more, got %', delay_ms
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF session_id < 0 THEN
        RAISE EXCEPTION 'dmq outbox send: session_id must be 0 or more, got %', session_id
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF topic IS NULL OR topic !~ '^[.a-zA-Z0-9_-]{1,64}(#ephemeral)?$' THEN
        RAISE EXCEPTION 'dmq outbox send: invalid topic name %: use 1-64 characters from [.a-zA-Z0-9_-], optionally ending in #ephemeral', quote_nullable(topic)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF body IS NULL THEN
        RAISE EXCEPTION 'dmq outbox send: body must not be NULL'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    INSERT INTO @schema@.outbox (topic, body, due_ms, session_id)
    VALUES (topic, body,
            floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint + delay_ms,
            session_id);
END
$$;

-- The same with a text body, stored as its UTF-8 bytes: for callers whose driver has no
-- easy bytea (psql, a JDBC setString). A bare literal body resolves to this one.
CREATE FUNCTION @schema@.send(topic text, body text, delay_ms bigint DEFAULT NULL,
                              session_id bigint DEFAULT NULL)
RETURNS void LANGUAGE sql VOLATILE AS $$
    SELECT @schema@.send(topic, convert_to(body, 'UTF8'), delay_ms, session_id);
$$;

-- Who may send is granted, not assumed (functions are executable by PUBLIC by default).
REVOKE EXECUTE ON FUNCTION @schema@.send(text, bytea, bigint, bigint) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION @schema@.send(text, text, bigint, bigint) FROM PUBLIC;

-- Wakes the relay: one NOTIFY per INSERT statement, however many rows it added, carrying
-- the statement's highest id (distinct payloads, so PostgreSQL does not fold the
-- statements of one transaction into one notification; the relay reads the table, the
-- payload is a hint). Delivered at commit, never for a rolled-back transaction.
CREATE FUNCTION @schema@.notify_relay() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    newest bigint;
BEGIN
    SELECT max(id) INTO newest FROM inserted;
    IF newest IS NOT NULL THEN
        PERFORM pg_notify(@channel@, newest::text);
    END IF;
    RETURN NULL;
END
$$;
REVOKE EXECUTE ON FUNCTION @schema@.notify_relay() FROM PUBLIC;

CREATE TRIGGER outbox_notify_relay AFTER INSERT ON @schema@.outbox
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION @schema@.notify_relay();

-- prune_inbox(older_than, batch): delete up to `batch` inbox records processed more than
-- `older_than` ago, oldest first; returns how many went. For the operator's role (`dmq
-- outbox prune-inbox`), not the application's: a record deleted while its message can
-- still be redelivered lets the handler run twice, so who deletes is kept apart from who
-- writes. Bounded per call, so no statement holds many row locks or runs long.
CREATE FUNCTION @schema@.prune_inbox(older_than interval, batch integer DEFAULT 10000)
RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    removed bigint;
BEGIN
    IF older_than IS NULL OR older_than <= interval '0' THEN
        RAISE EXCEPTION 'dmq outbox prune_inbox: older_than must be positive, got %', quote_nullable(older_than)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF batch IS NULL OR batch < 1 THEN
        RAISE EXCEPTION 'dmq outbox prune_inbox: batch must be 1 or more, got %', quote_nullable(batch)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    DELETE FROM @schema@.inbox
    WHERE ctid = ANY (ARRAY(
        SELECT ctid FROM @schema@.inbox
        WHERE processed_at < now() - older_than
        ORDER BY processed_at
        LIMIT batch));
    GET DIAGNOSTICS removed = ROW_COUNT;
    RETURN removed;
END
$$;
REVOKE EXECUTE ON FUNCTION @schema@.prune_inbox(interval, integer) FROM PUBLIC;
