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

-- name: prune_inbox
-- One bounded batch of old inbox records.
SELECT @schema@.prune_inbox(make_interval(secs => %(older_than_s)s), %(batch)s);
