-- dmq schema, version 8: topics placed on named PostgreSQL clusters.
--
-- A node may connect to several PostgreSQL clusters (--pg-cluster NAME=DSN besides the
-- main one) and every reliable topic is placed on one of them: its messages, delayed
-- messages, cursors and dead letters live in that cluster's database. Every cluster's
-- database holds the registry's rows (dmq_topic, dmq_channel) of every topic: the group
-- commit reads a channel's start_id there, and a topic's `cluster` says where it is
-- placed, which the group commit checks (a node whose view of the registry is stale
-- cannot store a moved topic's message on its old cluster). `draining` lists the clusters
-- a topic was moved away from whose copies are still being delivered.

ALTER TABLE dmq_topic ADD COLUMN cluster text NOT NULL DEFAULT 'main';
ALTER TABLE dmq_topic ADD COLUMN draining text[] NOT NULL DEFAULT '{}';

-- Which cluster this database is, and its id slot: every id this database draws for a
-- message, a delayed message or a dead letter lies in [slot << 48, (slot + 1) << 48), so
-- an id names its cluster (an ack, a replay, a trace finds the database by the id) and
-- ids never collide between clusters (below 2^53: exact in JavaScript). A database is
-- 'main', slot 0, until a node claims it for another cluster (`claimed`).
CREATE TABLE dmq_cluster_self (
    one      boolean PRIMARY KEY DEFAULT true CHECK (one),
    name     text NOT NULL,
    slot     integer NOT NULL CHECK (slot >= 0 AND slot < 32),
    claimed  boolean NOT NULL DEFAULT false
);
INSERT INTO dmq_cluster_self (name, slot) VALUES ('main', 0);

-- On the main cluster's database: every cluster's name and slot (assigned once, never
-- reused), so that the CLI can check a cluster name and two clusters never share a slot.
CREATE TABLE dmq_cluster (
    name  text PRIMARY KEY,
    slot  integer NOT NULL UNIQUE CHECK (slot >= 0 AND slot < 32)
);
INSERT INTO dmq_cluster (name, slot) VALUES ('main', 0);
