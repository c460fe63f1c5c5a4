-- dmq outbox, version 2: the install's own tag, so that each install numbers its rows
-- apart from every earlier one.
--
-- The relay stores an outbox row as producer 'outbox:NAME:TAG' with the row's id as its
-- session id (dmq_server/core/outbox_rows.py). The ids restart at 1 when the schema is
-- dropped and installed again; under one producer for every install, a new row 7 would
-- meet the earlier install's row 7, still stored in dmq under (producer, 7) within
-- --message-retention, be answered as a repeat of it and deleted: a committed message
-- lost. A random tag per install gives each numbering its own producer. The relay reads
-- the tag in the statement that reads the rows (one snapshot: a row is always numbered
-- under the install that holds it). 32 random bits (the first 8 hex digits of a version 4
-- UUID): two installs of one outbox share a tag with a chance of 1 in 4 billion.
--
-- What a tag cannot tell apart: the same install whose ids went back, as after
-- TRUNCATE ... RESTART IDENTITY on the outbox or a restore of the application database
-- from a backup (the table is restored with its tag); docs/client.md says what to do.
-- An install made before this version gets its tag here; rows it relayed before are
-- stored under producer 'outbox:NAME' and are not in the outbox any more, unless the
-- relay died between store and delete: relay the outbox empty before upgrading.
--
-- Readable by every role with USAGE on the schema: the tag is no secret (it is in the
-- producer id of every message relayed), and a relay's role needs no grant beyond those
-- docs/client.md names (USAGE on the schema, SELECT and DELETE on the outbox).
CREATE TABLE @schema@.installation (
    one           boolean PRIMARY KEY DEFAULT true CHECK (one),  -- a single row
    tag           text NOT NULL CHECK (tag ~ '^[0-9a-f]{8}$'),
    installed_at  timestamptz NOT NULL DEFAULT now()
);

INSERT INTO @schema@.installation (tag) VALUES (left(gen_random_uuid()::text, 8));
GRANT SELECT ON @schema@.installation TO PUBLIC;
