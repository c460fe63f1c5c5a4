-- dmq schema, version 14: outboxes attached at run time (`dmq outbox attach`).
--
-- Besides --outbox NAME=APP_DSN on a node's command line, an operator attaches an outbox
-- to the whole installation: a row here, read by every node every --registry-refresh
-- (and at once when ZooKeeper's /dmq/outbox tells the nodes of a cluster that it
-- changed), so each running node starts a relay for it, or stops the relay of one
-- detached, without a restart (dmq_server/protocols/outbox_relay.py, OutboxRelays). The
-- DSN is the application database's and may hold a password: it stays in this table,
-- never in ZooKeeper, a log line or a listing (those show host and database only).
CREATE TABLE dmq_outbox_attached (
    name         text PRIMARY KEY,
    schema_name  text NOT NULL,
    dsn          text NOT NULL,
    attached_at  timestamptz NOT NULL DEFAULT now()
);
