-- The outboxes attached at run time, in dmq's OWN database (dmq_server.db.outbox_attached;
-- schema version 14). `dmq outbox attach` and `detach` write them; every node reads them
-- (protocols/outbox_relay.py, OutboxRelays) to start and stop its relays.

-- name: attach_outbox
-- Attach an outbox under a name not attached yet (no row returned: the name is taken).
INSERT INTO dmq_outbox_attached (name, schema_name, dsn)
VALUES (%(name)s, %(schema)s, %(dsn)s)
ON CONFLICT (name) DO NOTHING
RETURNING name;

-- name: detach_outbox
-- Detach an outbox (no row returned: it was not attached).
DELETE FROM dmq_outbox_attached WHERE name = %(name)s RETURNING schema_name, dsn;

-- name: attached_outboxes
-- Every attached outbox, by name: what each node relays besides its --outbox.
SELECT name, schema_name, dsn FROM dmq_outbox_attached ORDER BY name;
