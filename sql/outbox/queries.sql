-- The installer's statements for an application database's outbox schema
-- (dmq_server.db.outbox). @schema@ is the schema's name, checked by the installer.

-- name: lock_install
-- Serialise concurrent installers of one schema (two deploys at once).
SELECT pg_advisory_xact_lock(7361044, hashtext(%(schema)s));

-- name: create_schema
-- The schema itself; an existing one is only reused when it holds the version table.
CREATE SCHEMA IF NOT EXISTS @schema@;

-- name: create_version_table
-- The outbox's migration ledger, in its own schema (the application's database is not
-- dmq's: dmq_schema_version belongs to dmq's own database).
CREATE TABLE IF NOT EXISTS @schema@.schema_version (
    version     integer PRIMARY KEY,
    description text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- name: installed_versions
-- Versions already applied.
SELECT version FROM @schema@.schema_version ORDER BY version;

-- name: record_version
-- Mark one migration applied.
INSERT INTO @schema@.schema_version (version, description) VALUES (%(version)s, %(description)s);

-- name: schema_state
-- Is there a schema of that name, and does it hold the outbox's version table?
SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = %(schema)s),
       to_regclass(%(schema)s || '.schema_version') IS NOT NULL;

-- name: pending_count
-- Outbox rows not relayed yet (an uninstall would lose them).
SELECT count(*) FROM @schema@.outbox;

-- name: drop_schema
-- Uninstall: the schema and everything in it.
DROP SCHEMA @schema@ CASCADE;

-- name: retag
-- A new tag for the install (`dmq outbox retag`): the rows numbered from now on go as
-- another producer, never meeting those relayed before (after ids went back: a restore of
-- the application's database from a backup, TRUNCATE ... RESTART IDENTITY).
UPDATE @schema@.installation SET tag = left(gen_random_uuid()::text, 8), installed_at = now()
RETURNING tag, (SELECT tag FROM @schema@.installation);

-- name: prune_inbox
-- One bounded batch of old inbox records.
SELECT @schema@.prune_inbox(make_interval(secs => %(older_than_s)s), %(batch)s);

-- The relay's statements (dmq_server.protocols.outbox_relay, through db/outbox.py), on
-- its own connection to the application's database, in autocommit.

-- name: relay_lock
-- One relay per outbox: a session lock, held until this connection ends (a relay whose
-- node dies loses it with its connection, and another node's next try takes it). The
-- class id differs from lock_install's, so an install never waits for a running relay.
SELECT pg_try_advisory_lock(7361045, hashtext(%(schema)s));

-- name: relay_listen
-- The NOTIFY of outbox_notify_relay (one per INSERT statement, at its commit).
LISTEN @schema@;

-- name: relay_tag
-- The install's tag (0002_installation.sql), read when the relay takes the lock.
SELECT tag FROM @schema@.installation;

-- name: relay_read
-- The next committed rows in id order after `after` (the rows of one transaction in the
-- order it sent them); created_at becomes the message's producer time. Each row carries
-- the install's tag, read in the same snapshot (an InitPlan: once a statement), so rows
-- are never numbered under the tag of another install (an uninstall and install while
-- the relay holds its lock), and its properties document (headers: version 3's use of a
-- column every version has, so this reads an outbox of version 2 as well).
SELECT id, topic, body, due_ms, session_id, (extract(epoch FROM created_at) * 1000)::bigint,
       (SELECT tag FROM @schema@.installation), headers
FROM @schema@.outbox
WHERE id > %(after)s
ORDER BY id
LIMIT %(limit)s;

-- name: relay_read_past
-- relay_read without the rows of `exclude`: the batch being stored while this reads the
-- next (its delete comes after its store, so its rows are still here). Everything else
-- after `after` comes in id order as relay_read gives it, the rows committed since below
-- the batch's ids too. A hashed subplan: one probe a row, whatever the batch's size.
SELECT id, topic, body, due_ms, session_id, (extract(epoch FROM created_at) * 1000)::bigint,
       (SELECT tag FROM @schema@.installation), headers
FROM @schema@.outbox
WHERE id > %(after)s AND id NOT IN (SELECT unnest(%(exclude)b::bigint[]))
ORDER BY id
LIMIT %(limit)s;

-- name: relay_delete
-- Rows dmq stored (or recorded as dead letters): they are never read again. The ids (and
-- relay_read_past's) come as a binary array (dmq_server.db.arrays).
DELETE FROM @schema@.outbox WHERE id = ANY(%(ids)b::bigint[]);

-- name: relay_present
-- Which of these ids are still in the outbox (the ledger's records of the others can go).
SELECT id FROM @schema@.outbox WHERE id = ANY(%(ids)s::bigint[]);

-- name: relay_figures
-- What operators see of the outbox, cheaply (core.outbox_figures): the pending rows
-- counted up to a bound (a scan of at most that many rows), the age of the row with the
-- lowest id (one probe of the primary key) and the application_name of the session
-- holding relay_lock's lock in this database (a relay's names its node; key 2 of a
-- two-key advisory lock is objid, an oid).
SELECT (SELECT count(*) FROM (SELECT 1 FROM @schema@.outbox LIMIT %(bound)s) AS upto),
       (SELECT extract(epoch FROM clock_timestamp() - created_at)::float8
        FROM @schema@.outbox ORDER BY id LIMIT 1),
       (SELECT a.application_name
        FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
        WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
          AND l.classid = 7361045 AND l.objid = hashtext(%(schema)s)::oid
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
        LIMIT 1);
