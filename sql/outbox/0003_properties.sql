-- dmq outbox, version 3: a message's properties (issue 45: key, priority, headers), sent
-- with send(..., key => ..., priority => ..., headers => ...).
--
-- Where they are kept: the column version 1 reserved, outbox.headers (jsonb), holds the
-- whole properties document, the JSON object a dmq SEND carries in its status
-- (dmq_client.wire.properties: {"key": ..., "priority": ..., "headers": {...}}, only the
-- fields a message has), NULL for a message without any. Not three columns, because that
-- column is in every outbox since version 1: the relay reads an outbox of any version with
-- one statement (a dmq-server upgraded before `dmq outbox install` relays on as before,
-- with nothing to detect or switch), and this migration alters no table, so it takes no
-- ACCESS EXCLUSIVE lock on the application's busiest one and scans no row. The relay checks
-- each row's document by the rules of a SEND (a row written by hand that breaks one becomes
-- a dead letter naming it, like a row of an unknown topic). A document kept whole is also
-- what it becomes in dmq: one text, checked once. The Python client (dmq_client.outbox)
-- checks every rule before its insert; send() below checks the three that a caller from
-- plain SQL most often gets wrong (the priority's range, the key's size, headers that are
-- no JSON object), and leaves the rest (header names and values, the 4,096-byte bound) to
-- the relay. A row someone wrote into outbox.headers by hand before this version (nothing
-- of dmq's did) is read as a document from now on.
--
-- send() gets three parameters. A function cannot gain parameters in place, and an
-- overload beside the old one would make every call of the old form ambiguous (both match
-- with their defaults), so the new functions replace the old ones: every role that could
-- execute an old one may execute its replacement (its grants copied here), and a call of
-- the old form (dmq_client before this version, a psql line) is a call of the new one with
-- the defaults.
COMMENT ON COLUMN @schema@.outbox.headers IS
    'the message''s properties (key, priority, headers) as one JSON object, NULL for none (version 3)';

CREATE FUNCTION @schema@.send(topic text, body bytea, delay_ms bigint DEFAULT NULL,
                              session_id bigint DEFAULT NULL, key text DEFAULT NULL,
                              priority integer DEFAULT 0, headers jsonb DEFAULT NULL)
RETURNS void LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    props jsonb := '{}';
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
    IF priority IS NULL OR priority NOT BETWEEN 0 AND 9 THEN
        RAISE EXCEPTION 'dmq outbox send: priority must be 0 to 9, got %', coalesce(priority::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF key = '' OR octet_length(key) > 255 THEN
        RAISE EXCEPTION 'dmq outbox send: key must be 1 to 255 bytes, got %', octet_length(key)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF jsonb_typeof(headers) <> 'object' THEN
        RAISE EXCEPTION 'dmq outbox send: headers must be a JSON object of names to texts, got a JSON %',
            jsonb_typeof(headers)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF key IS NOT NULL THEN
        props := props || jsonb_build_object('key', key);
    END IF;
    IF priority <> 0 THEN
        props := props || jsonb_build_object('priority', priority);
    END IF;
    IF headers <> '{}' THEN
        props := props || jsonb_build_object('headers', headers);
    END IF;
    INSERT INTO @schema@.outbox (topic, body, due_ms, session_id, headers)
    VALUES (topic, body,
            floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint + delay_ms,
            session_id, NULLIF(props, '{}'));
END
$$;

CREATE FUNCTION @schema@.send(topic text, body text, delay_ms bigint DEFAULT NULL,
                              session_id bigint DEFAULT NULL, key text DEFAULT NULL,
                              priority integer DEFAULT 0, headers jsonb DEFAULT NULL)
RETURNS void LANGUAGE sql VOLATILE AS $$
    SELECT @schema@.send(topic, convert_to(body, 'UTF8'), delay_ms, session_id, key, priority, headers);
$$;

REVOKE EXECUTE ON FUNCTION @schema@.send(text, bytea, bigint, bigint, text, integer, jsonb) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION @schema@.send(text, text, bigint, bigint, text, integer, jsonb) FROM PUBLIC;

-- The old functions' grants (`dmq outbox install --role` printed them for the application's
-- roles) on their replacements, then the old functions go.
DO $$
DECLARE
    grant_sql text;
BEGIN
    FOR grant_sql IN
        SELECT format('GRANT EXECUTE ON FUNCTION %s TO %s%s', replacement,
                      CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END,
                      CASE WHEN a.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END)
        FROM (VALUES ('@schema@.send(text, bytea, bigint, bigint)'::regprocedure,
                      '@schema@.send(text, bytea, bigint, bigint, text, integer, jsonb)'),
                     ('@schema@.send(text, text, bigint, bigint)'::regprocedure,
                      '@schema@.send(text, text, bigint, bigint, text, integer, jsonb)')) AS f(old, replacement)
        JOIN pg_proc p ON p.oid = f.old
        CROSS JOIN LATERAL aclexplode(p.proacl) AS a
        WHERE a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner
    LOOP
        EXECUTE grant_sql;
    END LOOP;
END
$$;

DROP FUNCTION @schema@.send(text, text, bigint, bigint);
DROP FUNCTION @schema@.send(text, bytea, bigint, bigint);
