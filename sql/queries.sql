-- name: create_schema_version
-- The migration ledger; created under the migration lock, before any migration runs.
CREATE TABLE IF NOT EXISTS dmq_schema_version (
    version     integer PRIMARY KEY,
    description text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- name: lock_migrations
-- Serialise concurrent migrators (two nodes starting at once).
SELECT pg_advisory_xact_lock(7361001);

-- name: schema_versions
-- Versions already applied.
SELECT version FROM dmq_schema_version ORDER BY version;

-- name: record_migration
-- Mark one migration applied.
INSERT INTO dmq_schema_version (version, description) VALUES (%(version)s, %(description)s);

-- name: ping
-- Is the database answering?
SELECT 1;

-- name: list_topics
-- Every topic with its settings and channels, for the registry cache and the CLI.
SELECT t.name, t.store, t.msg_timeout_ms, t.rate_limit, t.ttl_ms, t.max_attempts,
       coalesce(array_agg(c.name ORDER BY c.name) FILTER (WHERE c.name IS NOT NULL), '{}') AS channels,
       t.cluster, t.draining, t.ordered, t.retention_ms, t.registry_epoch, t.version
FROM dmq_topic t LEFT JOIN dmq_channel c ON c.topic = t.name
GROUP BY t.name
ORDER BY t.name;

-- name: create_topic
-- Register a topic; returns nothing if it already exists. Each change of a topic's row in
-- the registry (without ZooKeeper, this database's) takes a new version (0019).
INSERT INTO dmq_topic (name, store, msg_timeout_ms, rate_limit, ttl_ms, max_attempts, cluster, ordered, retention_ms,
                       version)
VALUES (%(name)s, %(store)s, %(msg_timeout_ms)s, %(rate_limit)s, %(ttl_ms)s, %(max_attempts)s, %(cluster)s,
        %(ordered)s, %(retention_ms)s, nextval('dmq_topic_version'))
ON CONFLICT (name) DO NOTHING
RETURNING name;

-- name: place_topic
-- Move a topic to another cluster (new sends go there) and set the clusters whose
-- copies are still being delivered (``dmq topic move``); the old placement is returned.
UPDATE dmq_topic t SET cluster = %(cluster)s, draining = %(draining)s,
    version = greatest(t.version + 1, nextval('dmq_topic_version'))
FROM (SELECT name, cluster, draining FROM dmq_topic WHERE name = %(name)s FOR UPDATE) AS old
WHERE t.name = old.name
RETURNING old.cluster, old.draining;

-- name: lock_topic_settings
-- One topic's changeable settings and its store (which decides whether it can be ordered),
-- the row locked until the update commits.
SELECT msg_timeout_ms, rate_limit, ttl_ms, max_attempts, ordered, retention_ms, store
FROM dmq_topic WHERE name = %(name)s FOR UPDATE;

-- name: update_topic_settings
-- Replace a topic's settings (not its store, not its channels). A change of ``ordered``
-- applies to the deliveries from then on, copies already waiting included.
UPDATE dmq_topic
SET msg_timeout_ms = %(msg_timeout_ms)s, rate_limit = %(rate_limit)s,
    ttl_ms = %(ttl_ms)s, max_attempts = %(max_attempts)s, ordered = %(ordered)s,
    retention_ms = %(retention_ms)s, version = greatest(version + 1, nextval('dmq_topic_version'))
WHERE name = %(name)s;

-- name: delete_topic
-- Remove a topic, its channels (cascade) and their cursors: its undelivered copies are gone.
WITH gone AS (DELETE FROM dmq_topic WHERE name = %(name)s RETURNING name),
     cursors AS (DELETE FROM dmq_cursor WHERE topic = %(name)s),
     attempts AS (DELETE FROM dmq_attempts WHERE topic = %(name)s)
SELECT name FROM gone;

-- name: add_channel
-- Register a channel (consumer group) on a topic; nothing if already there. Its messages
-- are those stored from now on: ids above the id sequence's next value.
INSERT INTO dmq_channel (topic, name, start_id)
VALUES (%(topic)s, %(name)s, nextval(pg_get_serial_sequence('dmq_message', 'id')))
ON CONFLICT (topic, name) DO NOTHING
RETURNING name;

-- name: remove_channel
-- Unregister a channel and drop its cursors: its undelivered copies are gone.
WITH gone AS (DELETE FROM dmq_channel WHERE topic = %(topic)s AND name = %(name)s RETURNING name),
     cursors AS (DELETE FROM dmq_cursor WHERE topic = %(topic)s AND channel = %(name)s),
     attempts AS (DELETE FROM dmq_attempts WHERE topic = %(topic)s AND channel = %(name)s)
SELECT name FROM gone;

-- name: insert_messages
-- Group commit: store a batch, owned by this server's incarnation, and answer with the
-- rows stored and, once per topic, the channels they are for.
-- The owner row is share-locked first: an owner retired by a takeover stores nothing
-- more (the answer has no message rows and the writer fails the batch as fenced).
-- A row whose topic is not placed on this database's cluster (moved away: the sender's
-- view of the registry is stale) is not stored, so no copy lands where no channel drains
-- once the statements that began before the move's fence have ended (topic_leftovers).
-- Array parameters use binary placeholders: text arrays cost the server ~20 us a row.
-- Rows whose (producer, session_id) is already stored are skipped (resends).
-- produced_ms is the producer's clock: only Unix milliseconds up to 9999-12-31 become a
-- timestamp, so no value can fail the whole batch (the broker refuses others first); it
-- becomes one by interval arithmetic, not to_timestamp(produced_ms / 1000.0), whose numeric
-- division cost ~2,200 instructions a row (bench/pg_cost.py). Both read back as the same
-- milliseconds for every allowed value (beyond the year 2255 both are a few microseconds
-- off; tests/integration/test_store_insert.py). Every row's published_at is the
-- transaction's now(), so its milliseconds are computed once (an InitPlan), not per row
-- (~2,700 instructions a row).
-- What is done once a batch stays out of the rows' way (bench/pg_cost.py, session 25:
-- 71,000 -> 58,000 instructions a row): the batch's topics come as their own short array
-- (batch_topics), so the placement and the channels are looked up without passing over
-- the rows; the rows are one filtered scan of the input, with no join and no sort; and
-- the channels are answered once per topic, not with every row. The arrays are unnested
-- in a select list, which hands each row on as it makes it: unnest in FROM first copies
-- every row into a tuplestore (~3,400 instructions a row, session 26).
-- Lock order: concurrent writers cannot deadlock on a pair both insert, because each
-- inserts its rows in the order it sent them, sorted by (producer, session_id) (the
-- server sorts the batch; insert_messages_steps): a scan with filters keeps its input's
-- order. (An ORDER BY here cost ~4,500 instructions a row even on sorted input: the sort
-- copies every row, body included.)
-- The answer: a row (id, producer, session_id, published_ms, topic, NULL, NULL) per
-- message stored, and a row (NULL, NULL, NULL, NULL, topic, name, start_id) per channel of
-- the batch's topics, in no order (the server orders a topic's names; two aggregates with
-- ORDER BY, a sort each, cost ~46,000 instructions a statement, bench/pg_cost.py --batch 1,
-- session 27): a message is for the channels registered in this snapshot with a lower
-- start_id. A channel whose registration commits while this
-- runs can own some of these rows without being named: the server has it read them from
-- the store once an answer names it (ReliableStore._confirm_channels).
-- A batch that holds outbox rows runs insert_outbox_messages instead: this statement with
-- the record of those rows added (db.messages, from sql/outbox/ledger.sql's parts), the
-- gate made a CTE (``gate``) that the record and the rows both read.
-- An ordered topic's commits are serialised across nodes (issue 45): the statement takes
-- the transaction advisory lock (7361004, hashtext(topic)) of each ordered topic of the
-- batch before it draws an id, and holds it until its commit is visible. So the visible
-- ids of an ordered topic are always a prefix of those it will ever have: a node that
-- loads every owner's copies of it (the topic's orderer) never passes a lower id that
-- another node has drawn but not committed yet. The locks are taken in the topics' name
-- order (move_due takes them in the same order), so two batches with several ordered
-- topics do not deadlock on them (only two pairs of names that share a hash, locked in
-- crossed orders, could: PostgreSQL would fail one of the batches).
-- The gate of the rows, evaluated once (an InitPlan) at the first row, before that row
-- draws its id: the owner share-locked, then the batch's topics placed here read (the
-- ordered ones locked), and the answer is the batch's topics NOT placed here, NULL when
-- the owner is retired; a row is stored if its topic is not among them. Until issue 48
-- the owner, the placed topics and now()'s milliseconds were CTEs and the rows were
-- joined to the placed topics by a hash join; a plan's every node is set up on every
-- execution (ExecutorStart was a third of a one-send statement), used or not. As the
-- gate: 340,100 -> 323,000 PostgreSQL instructions a statement of one send
-- (bench/pg_cost.py --batch 1), 76,200 -> 73,600 a message at --batch 10, 48,300 ->
-- 47,400 at --batch 200. Looking each topic of batch_topics up in turn (a SubPlan, in a
-- sorted array's order: no Sort) cost 305,200 at one topic, but ~14,000 more a topic
-- than one scan of dmq_topic for all (20 topics in a batch of 20: 79,900 -> 93,800 a
-- message).
WITH ins AS (
    INSERT INTO dmq_message (topic, producer, session_id, produced_at, node_id, owner, body)
    SELECT topic, producer, session_id,
           CASE WHEN produced_ms BETWEEN 1 AND 253402300799999
                THEN timestamptz 'epoch' + produced_ms * interval '1 millisecond' END,
           %(node_id)s, %(owner)s::integer, body
    FROM (SELECT unnest(%(topics)b::text[]) AS topic, unnest(%(producers)b::text[]) AS producer,
                 unnest(%(session_ids)b::bigint[]) AS session_id,
                 unnest(%(produced_ms)b::bigint[]) AS produced_ms, unnest(%(bodies)b::bytea[]) AS body
         ) AS input
    WHERE topic <> ALL(CASE WHEN EXISTS (SELECT FROM dmq_owner WHERE id = %(owner)s::integer AND retired_at IS NULL FOR SHARE)
        -- the batch's topics not placed here (nearly always none: a row passes at a glance)
        THEN ARRAY(SELECT b.name FROM unnest(%(batch_topics)b::text[]) AS b(name)
                   WHERE b.name <> ALL(ARRAY(
                       -- placement read, not locked (a lock would cost every batch a multixact
                       -- and WAL): a move waits instead until every transaction that began before
                       -- its fence has ended (topic_leftovers). A volatile function of the select
                       -- list runs after the sort: the ordered topics locked in name order.
                       SELECT p.name FROM (
                           SELECT t.name, CASE WHEN t.ordered THEN pg_advisory_xact_lock(7361004, hashtext(t.name)) END
                           FROM dmq_topic t
                           WHERE t.name = ANY(%(batch_topics)b::text[]) AND t.cluster = (SELECT s.name FROM dmq_cluster_self s)
                           ORDER BY t.name) AS p))) END)
    ON CONFLICT (producer, session_id) DO NOTHING
    RETURNING id, topic, producer, session_id
)
SELECT id, producer, session_id, (SELECT (extract(epoch FROM now()) * 1000)::bigint), topic, NULL::text, NULL::bigint
FROM ins
UNION ALL
SELECT NULL, NULL, NULL, NULL, c.topic, c.name, c.start_id
FROM dmq_channel c
WHERE c.topic = ANY(%(batch_topics)b::text[]);

-- name: find_messages
-- The stored rows for resent (producer, session_id) pairs.
SELECT m.id, m.producer, m.session_id,
       (extract(epoch FROM m.published_at) * 1000)::bigint AS published_ms
FROM dmq_message m
JOIN unnest(%(producers)b::text[], %(session_ids)b::bigint[]) AS u(producer, session_id)
  ON m.producer = u.producer AND m.session_id = u.session_id;

-- name: ack_deliveries
-- Make a batch of acknowledgements durable. The acker's node, which holds the copies in
-- memory, proposes for each (topic, channel, owner) a floor and the ranges it knows to be
-- done (the acknowledged copies among them): both are merged into the cursor, never
-- taken back (a floor only rises, done ranges only grow). In a cluster (``fenced``) only
-- a cursor the proposing node still holds moves: a node frozen past its ZooKeeper
-- session wakes with acks queued (or unread in its sockets) for copies another node has
-- taken over and may not have pushed yet; applied, they would make that node's next push
-- a delivery after a durable ack (the chaos suite's node-pause counted one). The holder
-- is checked on the row as locked, so a claim and an ack are ordered either way. And a
-- cursor moves only by a proposal of its channel's epoch or a later one (0021): a seek
-- (`dmq channel seek`) rewrites the cursors with a new epoch, and the acks of copies
-- pushed before it, applied over it, would take back the replay it asked for; the epoch
-- too is checked on the row as locked (and on the channel, for a cursor with no row yet).
-- The statement returns the cursors it did not move; their acks are not logged either. Each acknowledged copy that
-- was not done before is logged once, with the consumer that acknowledged it and when
-- that delivery was pushed (the message trace); attempts kept for a copy go with it.
-- The facts are one dmq_delivery_batch row of parallel arrays (schema version 10): when
-- every ack is new, which is nearly always, the statement's own arrays go in as they came
-- (a row per ack cost ~5-14 us of PostgreSQL CPU and 200 bytes of WAL each,
-- bench/ack_cost.py); only a batch holding a repeat is built again from the new acks.
-- "Done before" is read once per cursor of the batch (``before``), not once per ack: the
-- server sends each (topic, channel, owner) group of the batch with its lowest and highest
-- id and its number of acks (``g_*``), and the acks whose attempts were kept (``c_*``,
-- nearly always none), so the per-ack arrays are only unnested when a batch must be built
-- again (unnesting them every time cost 1-3 us of PostgreSQL CPU per ack, session 17).
WITH cursors AS (
    SELECT * FROM unnest(%(k_topics)b::text[], %(k_channels)b::text[], %(k_owners)b::integer[],
                         %(k_floors)b::bigint[], %(k_epochs)b::bigint[])
             WITH ORDINALITY AS k(topic, channel, owner, floor, epoch, n)
), spans AS (
    SELECT r.n, range_agg(int8range(r.lo, r.hi, '[]')) AS done
    FROM unnest(%(r_cursors)b::bigint[], %(r_lo)b::bigint[], %(r_hi)b::bigint[]) AS r(n, lo, hi)
    GROUP BY r.n
), proposed AS MATERIALIZED (
    -- each cursor of the batch with its row as it is now, locked before it is merged into
    -- (``had``): a transaction that changed the row after this statement's snapshot was
    -- taken (an expiry pass, which dead-letters copies and marks them done, or waits
    -- holding the row) has committed when the lock is granted, and the lock reads the
    -- version it left. Read from the snapshot, the cursor did not show the expiry's mark
    -- and the copy was logged as acknowledged besides (test_ack_expiry_race.py). A row
    -- the snapshot does not hold is not found here at all: one the sweep opened after this
    -- statement began (and may have expired copies in since) is met only by the upsert
    -- below, and `batch` then fails the statement, to be run again (see there).
    SELECT k.topic, k.channel, k.owner, greatest(k.floor, ch.start_id) AS floor,
           coalesce(s.done, '{}'::int8multirange) AS done, k.epoch, had.floor AS had_floor, had.done AS had_done
    FROM cursors k
    JOIN dmq_channel ch ON ch.topic = k.topic AND ch.name = k.channel AND k.epoch >= ch.epoch
    LEFT JOIN spans s ON s.n = k.n
    LEFT JOIN LATERAL (
        -- its done ranges copied once (load_backlog says why)
        SELECT c.floor, c.done + '{}'::int8multirange AS done FROM dmq_cursor c
        WHERE c.topic = k.topic AND c.channel = k.channel AND c.owner = k.owner
        FOR UPDATE
    ) had ON true
), saved AS (
    INSERT INTO dmq_cursor AS c (topic, channel, owner, holder, floor, done, epoch)
    SELECT topic, channel, owner, %(holder)s::text, floor,
           done - int8multirange(int8range(NULL, floor, '(]')), epoch
    FROM proposed
    ON CONFLICT (topic, channel, owner) DO UPDATE
    SET floor = greatest(c.floor, EXCLUDED.floor),
        done = (c.done + EXCLUDED.done)
               - int8multirange(int8range(NULL, greatest(c.floor, EXCLUDED.floor), '(]')),
        epoch = EXCLUDED.epoch
    WHERE (NOT %(fenced)s::boolean OR c.holder = EXCLUDED.holder) AND c.epoch <= EXCLUDED.epoch
    -- whether the row was there (merged into) or is new: a row version written by this
    -- upsert's update carries the updating transaction in xmax, one it inserted carries 0
    -- (PostgreSQL 15 has no RETURNING old)
    RETURNING topic, channel, owner, c.xmax <> '0'::xid AS found
), counted AS MATERIALIZED (
    -- the acks whose attempts were kept (nearly always none), of the cursors moved: read
    -- first, so that the DELETE looks up only their keys
    SELECT u.topic, u.channel, u.message_id
    FROM unnest(%(c_topics)b::text[], %(c_channels)b::text[], %(c_owners)b::integer[], %(c_ids)b::bigint[])
         AS u(topic, channel, owner, message_id)
    WHERE EXISTS (SELECT 1 FROM saved s WHERE s.topic = u.topic AND s.channel = u.channel AND s.owner = u.owner)
), cleared AS (
    DELETE FROM dmq_attempts a USING counted u
    WHERE a.topic = u.topic AND a.channel = u.channel AND a.message_id = u.message_id
), before AS MATERIALIZED (
    -- each cursor the batch moved as it was before this statement (as locked: its own
    -- changes are not visible here), with its acks' lowest and highest id and their
    -- number; a channel no longer registered, or a cursor held by another node, has no
    -- row, so its acks are not logged
    SELECT k.topic, k.channel, k.owner, coalesce(p.had_floor, ch.start_id) AS floor,
           p.had_done AS done, k.low, k.high, k.acks, s.found AND p.had_floor IS NULL AS unseen
    FROM unnest(%(g_topics)b::text[], %(g_channels)b::text[], %(g_owners)b::integer[],
                %(g_low)b::bigint[], %(g_high)b::bigint[], %(g_acks)b::bigint[])
         AS k(topic, channel, owner, low, high, acks)
    JOIN saved s ON s.topic = k.topic AND s.channel = k.channel AND s.owner = k.owner
    JOIN dmq_channel ch ON ch.topic = k.topic AND ch.name = k.channel
    JOIN proposed p ON p.topic = k.topic AND p.channel = k.channel AND p.owner = k.owner
), batch AS MATERIALIZED (
    -- every ack is new when every ack's channel is registered and, per cursor, none lies
    -- at or below the floor or among the done ranges: decided per cursor, not per ack
    -- A cursor with acks whose row was there when the upsert merged into it but not in
    -- this statement's snapshot (`proposed` found none, `unseen`): the sweep opened it
    -- after the statement began and may have expired copies of it since, so what was done
    -- before is unknown here, and an ack of a copy the sweep dead-lettered would be logged
    -- too. The statement fails whole by a division by zero (nothing applied, nothing
    -- logged) and ack_deliveries_steps runs it again, with a snapshot that holds the row.
    -- The guard is the first term, so it is always evaluated, and in the one aggregate
    -- over `before`: as a subquery of its own it cost the statement about 17,000
    -- instructions more (bench/pg_cost.py --batch 10: 50,750 against 33,750 in all).
    SELECT nextval('dmq_delivery_batch_id_seq') AS id,
           coalesce((SELECT 1 / (NOT coalesce(bool_or(unseen), false))::integer = 1
                            AND sum(acks) = cardinality(%(message_ids)b::bigint[])
                            AND bool_and(low > floor AND NOT coalesce(done && int8range(low, high, '[]'), false))
                     FROM before), false) AS all_new
), logged AS (
    INSERT INTO dmq_delivery_batch (id, first_fact, acked_at, low_id, high_id, topics, channels, message_ids,
                                    published_ms, first_ms, acked_ms, attempts, consumers, delivered_ms)
    SELECT b.id, b.id << 20, to_timestamp(%(last_acked_ms)s::bigint / 1000.0), %(low_id)s::bigint, %(high_id)s::bigint,
           %(topics)b::text[], %(channels)b::text[], %(message_ids)b::bigint[], %(published_ms)b::bigint[],
           %(first_ms)b::bigint[], %(acked_ms)b::bigint[], %(attempts)b::integer[], %(consumers)b::text[],
           %(delivered_ms)b::bigint[]
    FROM batch b
    WHERE b.all_new
    UNION ALL
    -- some ack was done before (a repeat), its channel is gone or its cursor is held by
    -- another node: the others, one by one
    -- (the uncorrelated condition is checked once, before anything here is unnested)
    SELECT (SELECT id FROM batch), (SELECT id FROM batch) << 20, to_timestamp(max(u.acked_ms) / 1000.0),
           min(u.message_id), max(u.message_id),
           array_agg(u.topic ORDER BY u.n), array_agg(u.channel ORDER BY u.n), array_agg(u.message_id ORDER BY u.n),
           array_agg(u.published_ms ORDER BY u.n), array_agg(u.first_ms ORDER BY u.n),
           array_agg(u.acked_ms ORDER BY u.n), array_agg(u.attempts ORDER BY u.n),
           array_agg(u.consumer ORDER BY u.n), array_agg(u.delivered_ms ORDER BY u.n)
    FROM unnest(%(topics)b::text[], %(channels)b::text[], %(owners)b::integer[],
                %(message_ids)b::bigint[], %(published_ms)b::bigint[], %(first_ms)b::bigint[],
                %(acked_ms)b::bigint[], %(attempts)b::integer[], %(consumers)b::text[], %(delivered_ms)b::bigint[])
         WITH ORDINALITY AS u(topic, channel, owner, message_id, published_ms, first_ms, acked_ms, attempts,
                              consumer, delivered_ms, n)
    JOIN before k ON k.topic = u.topic AND k.channel = u.channel AND k.owner = u.owner
    WHERE NOT (SELECT all_new FROM batch)
      AND u.message_id > k.floor AND NOT coalesce(k.done @> u.message_id, false)
    HAVING count(*) > 0
)
-- the cursors of registered channels another node holds, or sought since the proposal's
-- epoch (nearly always none)
SELECT k.topic, k.channel, k.owner FROM cursors k
WHERE NOT EXISTS (SELECT 1 FROM saved s WHERE s.topic = k.topic AND s.channel = k.channel AND s.owner = k.owner)
  AND EXISTS (SELECT 1 FROM dmq_channel ch WHERE ch.topic = k.topic AND ch.name = k.channel)
ORDER BY k.topic, k.channel, k.owner;

-- name: load_backlog
-- A channel's stored, unacknowledged copies after a cursor, oldest first, with their
-- properties (key, priority, headers: NULL, 0, NULL for none): per owner, one
-- index range above the larger of the cursor and the owner's floor, skipping what is done.
-- Without a holder (one node) every owner's copies; with one (a cluster) the copies of
-- this node's own incarnation and of the owners whose cursors it holds. An ordered
-- topic's channel leaves out the keys whose copies it reads apart (skip_keys: a key with
-- more waiting than a share of its window), and reads those one key at a time (only_key).
-- An owner's range is read as every statement reading an owner's messages of a topic from
-- an id reads it: bounded by row comparisons over the placement index's columns, (hash,
-- owner, id) above the start and up to (hash, owner, max), in that index's order. With
-- `hashtext(topic) = h AND owner = o` alone the order reduces to the id's, which the
-- primary key gives too, and the planner walked it from the bound (a channel sought back
-- over 1 M of 10 M retained messages drained at 1,500 msgs/s) or from the first id (a
-- second e2e run after ANALYZE: 0.6 s a load, 4,000 msgs/s). With the row comparisons
-- alone, a topic newer than the statistics (its first backlog, before autovacuum's
-- ANALYZE) looked like one row, and its whole range was read by a bitmap heap scan and
-- sorted for a probe of 16 rows (74 ms). Both together keep the ordered scan of the
-- placement index in each case (tests/integration/test_message_keys.py's plans).
WITH ch AS (
    SELECT start_id, epoch FROM dmq_channel WHERE topic = %(topic)s AND name = %(channel)s
), owners AS (
    SELECT o.id FROM dmq_owner o
    WHERE %(holder)s::text IS NULL
       OR o.id = %(owner)s::integer
       OR EXISTS (SELECT 1 FROM dmq_cursor k
                  WHERE k.topic = %(topic)s AND k.channel = %(channel)s AND k.owner = o.id
                    AND k.holder = %(holder)s::text)
)
SELECT m.id, m.producer, m.session_id,
       (extract(epoch FROM m.published_at) * 1000)::bigint AS published_ms,
       m.body, coalesce(a.attempts, 0), m.owner, m.key, m.priority, m.headers, ch.epoch
FROM ch CROSS JOIN owners w
LEFT JOIN LATERAL (
    -- the owner's cursor, its done ranges read once: held as a column, a multirange of
    -- thousands of ranges (stored compressed, out of line) is read again for every row
    -- tested (with reads of 16 rows besides, a drain of 100,000 mixed priorities cost
    -- PostgreSQL 2.4-3.7 ms a message; both fixed, 25 us: docs/benchmarks.md "Priority");
    -- OFFSET 0 keeps the planner from folding the copy into the test
    SELECT c.floor, c.done + '{}'::int8multirange AS done FROM dmq_cursor c
    WHERE c.topic = %(topic)s AND c.channel = %(channel)s AND c.owner = w.id
    OFFSET 0
) k ON true
CROSS JOIN LATERAL (
    SELECT m.id, m.producer, m.session_id, m.published_at, m.body, m.owner, m.key, m.priority, m.headers
    FROM dmq_message m
    WHERE (hashtext(m.topic), m.owner, m.id) > (hashtext(%(topic)s), w.id, greatest(%(after)s, ch.start_id, coalesce(k.floor, 0)))
      AND (hashtext(m.topic), m.owner, m.id) <= (hashtext(%(topic)s), w.id, 9223372036854775807)
      AND hashtext(m.topic) = hashtext(%(topic)s) AND m.owner = w.id
      AND m.id > greatest(%(after)s, ch.start_id, coalesce(k.floor, 0))
      AND m.topic = %(topic)s
      AND (m.channel IS NULL OR m.channel = %(channel)s)
      AND NOT coalesce(k.done @> m.id, false)
      AND (m.key IS NULL OR m.key <> ALL(%(skip_keys)s::text[]))
      AND (%(only_key)s::text IS NULL OR m.key = %(only_key)s::text)
    ORDER BY hashtext(m.topic), m.owner, m.id
    LIMIT %(limit)s
) m
LEFT JOIN dmq_attempts a ON a.topic = %(topic)s AND a.channel = %(channel)s AND a.message_id = m.id
ORDER BY m.id
LIMIT %(limit)s;

-- name: load_priority_level
-- A channel's stored, unacknowledged copies of one priority above 0 (``priority``), oldest
-- first, with their properties: per owner, one range of dmq_message_priority_idx above the
-- larger of ``after`` (what the channel loaded of the level before), the channel's start and
-- the owner's floor, skipping what is done; owners as load_backlog's. A read-ahead runs it
-- for each level, highest first, asking each only for what the levels above left of its
-- limit (load_priority_backlog_steps): one statement over the nine levels read up to the
-- limit of each before sorting them (5,000 rows wanted, up to 45,000 read), 249-766 ms a
-- call in the priority drains against 15-41 ms a level this way (docs/benchmarks.md
-- "Priority").
-- The level is a row comparison over (priority, id) and a bound on priority, not an
-- equality: written as an equality, the placement index (hashtext(topic), owner, id) gives
-- the same order and the planner, with statistics older than the topic, takes it and
-- filters the level; ordered by (priority, id), only this index gives the order. Both
-- bounds follow equalities on the index's first two columns, so the scan starts at the
-- level's bound and stops at its end. ``m.priority > 0`` is written out: the planner uses
-- the partial index only when the statement's text implies its predicate.
WITH ch AS (
    SELECT start_id, epoch FROM dmq_channel WHERE topic = %(topic)s AND name = %(channel)s
), owners AS (
    SELECT o.id FROM dmq_owner o
    WHERE %(holder)s::text IS NULL
       OR o.id = %(owner)s::integer
       OR EXISTS (SELECT 1 FROM dmq_cursor k
                  WHERE k.topic = %(topic)s AND k.channel = %(channel)s AND k.owner = o.id
                    AND k.holder = %(holder)s::text)
)
SELECT m.id, m.producer, m.session_id,
       (extract(epoch FROM m.published_at) * 1000)::bigint AS published_ms,
       m.body, coalesce(a.attempts, 0), m.owner, m.key, m.priority, m.headers, ch.epoch
FROM ch CROSS JOIN owners w
LEFT JOIN LATERAL (
    -- the owner's cursor, its done ranges read once: held as a column, a multirange of
    -- thousands of ranges (stored compressed, out of line) is read again for every row
    -- tested (with reads of 16 rows besides, a drain of 100,000 mixed priorities cost
    -- PostgreSQL 2.4-3.7 ms a message; both fixed, 25 us: docs/benchmarks.md "Priority");
    -- OFFSET 0 keeps the planner from folding the copy into the test
    SELECT c.floor, c.done + '{}'::int8multirange AS done FROM dmq_cursor c
    WHERE c.topic = %(topic)s AND c.channel = %(channel)s AND c.owner = w.id
    OFFSET 0
) k ON true
CROSS JOIN LATERAL (
    SELECT m.id, m.producer, m.session_id, m.published_at, m.body, m.owner, m.key, m.priority, m.headers
    FROM dmq_message m
    WHERE hashtext(m.topic) = hashtext(%(topic)s) AND m.owner = w.id
      AND (m.priority, m.id) > (%(priority)s::smallint, greatest(%(after)s::bigint, ch.start_id, coalesce(k.floor, 0)))
      AND m.priority <= %(priority)s::smallint AND m.priority > 0 AND m.topic = %(topic)s
      AND (m.channel IS NULL OR m.channel = %(channel)s)
      AND NOT coalesce(k.done @> m.id, false)
    ORDER BY m.priority, m.id
    LIMIT %(limit)s
) m
LEFT JOIN dmq_attempts a ON a.topic = %(topic)s AND a.channel = %(channel)s AND a.message_id = m.id
ORDER BY m.id
LIMIT %(limit)s;

-- name: sweep_bounds
-- The retention sweep's range: the lowest stored id and the first message still inside the
-- window, looked for from `start` (the previous sweep's answer, or on a first pass a binary
-- search's: the walk of the primary key then passes only the messages that left the window
-- since, not every old one a channel or a longer retention still holds). With nothing older than the window stored, the two are the same id and the sweep
-- stops here. With nothing inside it, the highest id is where the next walk starts.
SELECT (SELECT min(id) FROM dmq_message) AS lowest, (SELECT max(id) FROM dmq_message) AS highest,
       (SELECT n.id FROM dmq_message n
        WHERE n.id >= %(start)s
          AND n.published_at >= now() - make_interval(secs => %(retention_s)s)
        ORDER BY n.id LIMIT 1) AS first_kept;

-- name: sweep_clock
-- The transaction's now() in ms since the epoch: where a retention's window starts, for the
-- search of its first pass (messages.py sweep_start_steps); the same now() sweep_bounds reads.
SELECT (extract(epoch FROM now()) * 1000)::bigint AS now_ms;

-- name: sweep_topics
-- The topics the retention sweep visits, with their retention (ms; NULL: the server's
-- --message-retention): every topic with a message stored, found by a loose scan of the
-- placement index (one descent per distinct hashtext(topic), not a read of every row), and
-- named either by the registry (each registered topic of a hash present) or, for a hash no
-- registered topic has, by its first stored row: the rows of a deleted topic, which
-- delete_topic leaves to the sweep. Registered topics without a message cost nothing.
WITH RECURSIVE hashes AS (
    (SELECT hashtext(m.topic) AS h FROM dmq_message m ORDER BY hashtext(m.topic) LIMIT 1)
    UNION ALL
    SELECT (SELECT hashtext(m.topic) FROM dmq_message m
            WHERE hashtext(m.topic) > s.h ORDER BY hashtext(m.topic) LIMIT 1)
    FROM hashes s WHERE s.h IS NOT NULL
)
SELECT t.name, t.retention_ms
FROM dmq_topic t JOIN hashes s ON s.h = hashtext(t.name)
UNION
SELECT f.topic, NULL
FROM hashes s
CROSS JOIN LATERAL (SELECT m.topic FROM dmq_message m WHERE hashtext(m.topic) = s.h
                    ORDER BY hashtext(m.topic), m.owner, m.id LIMIT 1) f
WHERE s.h IS NOT NULL AND NOT EXISTS (SELECT 1 FROM dmq_topic t WHERE hashtext(t.name) = s.h)
ORDER BY 1;

-- name: sweep_topic_lock
-- A topic's sweep, on one node at a time: the others skip it until the transaction ends.
-- First it waits for a seek of the topic under way (seek_channel holds 7361005
-- exclusively): no message a seek is making pending again is swept between its count and
-- its cursors; the DELETE, a later statement, sees what the seek wrote.
SELECT pg_advisory_xact_lock_shared(7361005, hashtext(%(topic)s::text)) AS waited,
       pg_try_advisory_xact_lock(7361006, hashtext(%(topic)s::text)) AS mine;

-- name: sweep_topic
-- One batch of a topic's retention sweep. Per incarnation (each one with rows of the topic,
-- by a loose scan of the index: also those retired and pruned since), a range of the index from
-- `after` (where the pass got to) up to `below` (the first id still inside the topic's
-- retention window, sweep_bounds with its retention), so the messages of other topics,
-- however many are retained, are never read.
-- A row at or below the point every channel of the topic is done to (`greatest(start_id,
-- floor)` of each channel's cursor of that incarnation) goes without a further test; above
-- it, the copies acknowledged out of order (`done`) or dead-lettered go once no channel waits
-- for them (the planner tests the cheap comparison first). The publish time is tested again
-- on each row: below `below` an id may still have been published inside the window (ids are
-- drawn after the transaction's now()). Returns each deleted id with its publish time (ms) and
-- its body's stored length (uncount_swept takes it off the topic's retained figures).
WITH RECURSIVE owners AS (
    (SELECT m.owner FROM dmq_message m WHERE hashtext(m.topic) = hashtext(%(topic)s::text)
     ORDER BY m.owner LIMIT 1)
    UNION ALL
    SELECT (SELECT m.owner FROM dmq_message m
            WHERE hashtext(m.topic) = hashtext(%(topic)s::text) AND m.owner > o.owner ORDER BY m.owner LIMIT 1)
    FROM owners o WHERE o.owner IS NOT NULL
), bounds AS MATERIALIZED (
    SELECT o.owner,
           (SELECT min(greatest(c.start_id, coalesce(k.floor, 0)))
            FROM dmq_channel c
            LEFT JOIN dmq_cursor k ON k.topic = c.topic AND k.channel = c.name AND k.owner = o.owner
            WHERE c.topic = %(topic)s) AS done_to
    FROM owners o WHERE o.owner IS NOT NULL
)
DELETE FROM dmq_message
WHERE id = ANY (ARRAY(
    SELECT v.id FROM bounds b
    CROSS JOIN LATERAL (
        SELECT m.id FROM dmq_message m
        WHERE (hashtext(m.topic), m.owner, m.id) > (hashtext(%(topic)s::text), b.owner, %(after)s)
          AND (hashtext(m.topic), m.owner, m.id) < (hashtext(%(topic)s::text), b.owner, %(below)s)
          AND m.topic = %(topic)s
          AND m.published_at < now() - make_interval(secs => %(retention_s)s)
          AND (m.id <= coalesce(b.done_to, %(below)s) OR NOT EXISTS (
                  SELECT 1 FROM dmq_channel c
                  LEFT JOIN dmq_cursor k ON k.topic = c.topic AND k.channel = c.name AND k.owner = m.owner
                  WHERE c.topic = m.topic
                    AND m.id > greatest(c.start_id, coalesce(k.floor, 0))
                    AND (m.channel IS NULL OR m.channel = c.name)
                    AND NOT coalesce(k.done @> m.id, false)))
        ORDER BY hashtext(m.topic), m.owner, m.id
        LIMIT %(limit)s
    ) v
    ORDER BY v.id
    LIMIT %(limit)s
))
RETURNING id, (extract(epoch FROM published_at) * 1000)::bigint AS published_ms, octet_length(body) AS bytes;

-- name: note_swept
-- What the sweep removed of a topic so far: the highest id and the newest publish time (ms).
-- Nothing the topic kept was published at or before `swept_ms`: the start of what a
-- channel of the topic can be sought back to (issue 46).
INSERT INTO dmq_retention (topic, swept_id, swept_ms)
VALUES (%(topic)s, %(swept_id)s, %(swept_ms)s)
ON CONFLICT (topic) DO UPDATE
SET swept_id = greatest(dmq_retention.swept_id, EXCLUDED.swept_id),
    swept_ms = greatest(dmq_retention.swept_ms, EXCLUDED.swept_ms);

-- name: uncount_swept
-- The sweep's batch (sweep_topic's rows: ids and body lengths) off the topic's retained
-- figures, in the delete's transaction: only the rows the count had reached (id <=
-- counted_to); those above it were never counted.
UPDATE dmq_retained r
SET messages = r.messages - d.n, bytes = r.bytes - d.b
FROM (SELECT count(*) AS n, coalesce(sum(u.len), 0) AS b
      FROM unnest(%(ids)s::bigint[], %(lengths)s::bigint[]) AS u(id, len)
      WHERE u.id <= (SELECT counted_to FROM dmq_retained WHERE topic = %(topic)s)) d
WHERE r.topic = %(topic)s AND d.n > 0;

-- name: count_settle_time
-- Where the retained count may go up to (db.messages.settle_point_steps): the database's
-- now and the start of its oldest writing transaction but ours (pg_stat_activity shows it for
-- sessions of the same role, as the nodes' are; a row that transaction inserts is not
-- visible yet, and no id below the count's point may still gain a row).
SELECT (extract(epoch FROM now()) * 1000)::bigint AS now_ms,
       (SELECT (extract(epoch FROM min(a.xact_start)) * 1000)::bigint
        FROM pg_stat_activity a
        WHERE a.backend_xid IS NOT NULL AND a.pid <> pg_backend_pid()
          AND a.datname = current_database()) AS oldest_writer_ms;

-- name: retained_topics
-- The topics the count visits besides those with a message stored (sweep_topics): those
-- counted before, so a topic whose rows all went is counted to the new point too (its
-- figures are exact up to now), and a deleted one's row is dropped.
SELECT topic FROM dmq_retained ORDER BY topic;

-- name: count_retained
-- One batch of a topic's retained count, under sweep_topic_lock: the topic's rows with an id in
-- (counted_to, `upto`] (`upto`: the settled point), per incarnation from the topic's index
-- (never another topic's rows), at most `limit` of them in id order; added to the figures
-- with the highest id read as the new counted_to when the batch is full, else `upto` (and
-- then `counted_ms` with it). octet_length of a bytea reads the length its header records (the
-- body's length as sent): no body is decompressed or fetched from TOAST. Returns the rows counted and the new counted_to.
WITH RECURSIVE owners AS (
    (SELECT m.owner FROM dmq_message m WHERE hashtext(m.topic) = hashtext(%(topic)s::text)
     ORDER BY m.owner LIMIT 1)
    UNION ALL
    SELECT (SELECT m.owner FROM dmq_message m
            WHERE hashtext(m.topic) = hashtext(%(topic)s::text) AND m.owner > o.owner ORDER BY m.owner LIMIT 1)
    FROM owners o WHERE o.owner IS NOT NULL
), prior AS (
    SELECT coalesce((SELECT counted_to FROM dmq_retained WHERE topic = %(topic)s), 0) AS counted_to
), picked AS MATERIALIZED (
    SELECT v.id, v.len FROM owners o
    CROSS JOIN prior p
    CROSS JOIN LATERAL (
        SELECT m.id, octet_length(m.body) AS len FROM dmq_message m
        WHERE (hashtext(m.topic), m.owner, m.id) > (hashtext(%(topic)s::text), o.owner, p.counted_to)
          AND (hashtext(m.topic), m.owner, m.id) <= (hashtext(%(topic)s::text), o.owner, %(upto)s)
          AND m.topic = %(topic)s
        ORDER BY hashtext(m.topic), m.owner, m.id
        LIMIT %(limit)s
    ) v
    WHERE o.owner IS NOT NULL
    ORDER BY v.id
    LIMIT %(limit)s
), total AS (
    SELECT count(*) AS n, coalesce(sum(len), 0) AS b, max(id) AS top FROM picked
)
INSERT INTO dmq_retained AS r (topic, counted_to, messages, bytes, counted_ms)
SELECT %(topic)s, CASE WHEN t.n >= %(limit)s THEN t.top ELSE greatest(p.counted_to, %(upto)s) END, t.n, t.b,
       CASE WHEN t.n >= %(limit)s THEN NULL ELSE %(counted_ms)s::bigint END
FROM total t CROSS JOIN prior p
ON CONFLICT (topic) DO UPDATE
SET counted_to = greatest(r.counted_to, EXCLUDED.counted_to),
    messages = r.messages + EXCLUDED.messages,
    bytes = r.bytes + EXCLUDED.bytes,
    counted_ms = CASE WHEN EXCLUDED.counted_ms IS NULL THEN r.counted_ms
                      ELSE greatest(r.counted_ms, EXCLUDED.counted_ms) END
RETURNING (SELECT n FROM total) AS counted, r.counted_to;

-- name: drop_retained
-- A deleted topic's figures, once nothing of it is stored (the sweep removed its rows):
-- only registered topics are reported, and a topic registered again starts from nothing.
DELETE FROM dmq_retained r
WHERE r.topic = %(topic)s
  AND NOT EXISTS (SELECT 1 FROM dmq_topic t WHERE t.name = r.topic)
  AND NOT EXISTS (SELECT 1 FROM dmq_message m
                  WHERE hashtext(m.topic) = hashtext(%(topic)s::text) AND m.topic = %(topic)s);

-- name: retained_figures
-- Every topic's retained figures on this cluster (the node reads them with the channel
-- state and adds up the clusters': a moved topic has rows on two).
SELECT topic, messages, bytes, counted_ms FROM dmq_retained ORDER BY topic;

-- name: channel_depths
-- Stored, unacknowledged copies per channel (`dmq stats`: reads every stored copy at once;
-- the server counts in slices, below).
SELECT topic, channel, count(*) AS depth
FROM dmq_pending GROUP BY topic, channel ORDER BY topic, channel;

-- name: depth_scan_start
-- Where a pass of the server's depth count begins (reliable/depths.py): the lowest point
-- below which a (channel, incarnation) waits for nothing. Below it every copy is done, so
-- the acknowledged messages that retention keeps there are not walked. With a cursor, its
-- floor (at least the channel's start); without one, just below the incarnation's first
-- message of the topic above the channel's start, found by one probe of the placement
-- index in its own order (its next entry: the primary key cannot give that order, so the
-- planner cannot walk it), and nothing when there is none: each server start is a new
-- incarnation with no cursor, and taking the channel's start for it walked every message
-- a topic kept since (10 M: a twentieth of a backend, the count's duty, for good). Nothing waiting
-- anywhere: from the highest id.
SELECT coalesce(min(s.start), (SELECT max(id) FROM dmq_message), 0)
FROM dmq_channel c
CROSS JOIN dmq_owner o
LEFT JOIN dmq_cursor k ON k.topic = c.topic AND k.channel = c.name AND k.owner = o.id
LEFT JOIN LATERAL (
    SELECT hashtext(m.topic) AS h, m.owner, m.id FROM dmq_message m
    WHERE k.owner IS NULL AND (hashtext(m.topic), m.owner, m.id) > (hashtext(c.topic), o.id, c.start_id)
    ORDER BY hashtext(m.topic), m.owner, m.id LIMIT 1
) f ON true
CROSS JOIN LATERAL (
    SELECT CASE WHEN k.owner IS NOT NULL THEN greatest(c.start_id, k.floor)
                WHEN f.h = hashtext(c.topic) AND f.owner = o.id THEN f.id - 1 END AS start
) s;

-- name: depth_slice_end
-- The last id of the next slice: the `rows`-th stored message above `low` (none: the
-- slice runs to the end).
SELECT id FROM dmq_message WHERE id > %(low)s ORDER BY id OFFSET %(rows)s - 1 LIMIT 1;

-- name: channel_depth_slice
-- Stored, unacknowledged copies per channel among the messages with ids in (low, high],
-- and the lowest of their ids: the bounds reach dmq_pending's scan of dmq_message as an
-- index range.
SELECT topic, channel, count(*) AS depth, min(message_id) AS lowest
FROM dmq_pending WHERE message_id > %(low)s AND message_id <= %(high)s
GROUP BY topic, channel ORDER BY topic, channel;

-- name: table_counts
-- Row counts for `dmq stats`.
SELECT (SELECT count(*) FROM dmq_message) AS messages,
       (SELECT count(*) FROM dmq_pending) AS deliveries,
       (SELECT coalesce(sum(cardinality(message_ids)), 0) FROM dmq_delivery_batch) AS delivery_log,
       (SELECT count(*) FROM dmq_dead_letter) AS dead_letters;

-- ---------------------------------------------------------------------------
-- Delayed messages, dead letters, limits and admin (schema version 3)
-- ---------------------------------------------------------------------------

-- name: insert_delayed
-- Store a batch of delayed messages; a (producer, session_id) already stored here
-- or in dmq_message is skipped (a resend) and looked up by find_delayed.
-- A batch that holds outbox rows runs insert_outbox_delayed instead: this statement with
-- the record of those rows added (db.delays, from sql/outbox/ledger.sql's parts).
WITH input AS (
    SELECT * FROM unnest(%(topics)b::text[], %(producers)b::text[], %(session_ids)b::bigint[],
                         %(produced_ms)b::bigint[], %(due_ms)b::bigint[], %(fragments)b::integer[],
                         %(bodies)b::bytea[])
             AS u(topic, producer, session_id, produced_ms, due_ms, fragment, body)
), placed AS MATERIALIZED (
    -- placed on this database's cluster (as insert_messages)
    SELECT t.name FROM dmq_topic t JOIN dmq_cluster_self s ON s.name = t.cluster
    WHERE t.name IN (SELECT DISTINCT topic FROM input)
)
INSERT INTO dmq_delay (fragment, due_ms, topic, producer, session_id, produced_ms, node_id, body)
SELECT i.fragment, i.due_ms, i.topic, i.producer, i.session_id, i.produced_ms, %(node_id)s, i.body
FROM input i
WHERE NOT EXISTS (SELECT 1 FROM dmq_message m
                  WHERE m.producer = i.producer AND m.session_id = i.session_id)
  AND i.topic IN (SELECT name FROM placed)
ORDER BY i.producer, i.session_id  -- one lock order, as insert_messages
ON CONFLICT (producer, session_id) DO NOTHING
RETURNING id, producer, session_id, due_ms;

-- name: find_delayed
-- The stored row of resent delayed pairs: still waiting (kind 'delay') or already
-- moved into the reliable flow (kind 'message').
SELECT d.id, d.producer, d.session_id, d.due_ms, 'delay' AS kind
FROM dmq_delay d
JOIN unnest(%(producers)b::text[], %(session_ids)b::bigint[]) AS u(producer, session_id)
  ON d.producer = u.producer AND d.session_id = u.session_id
UNION ALL
SELECT m.id, m.producer, m.session_id, 0, 'message'
FROM dmq_message m
JOIN unnest(%(producers)b::text[], %(session_ids)b::bigint[]) AS u(producer, session_id)
  ON m.producer = u.producer AND m.session_id = u.session_id;

-- name: peek_delayed
-- Due times in a worker's fragments up to a horizon (the next polling window), so
-- the worker can hold a timer for each instead of waiting for its next poll.
-- `overflow` adds fragments above max_fragment (rows left by a larger --delay-fragments).
SELECT due_ms FROM dmq_delay
WHERE (fragment = ANY(%(fragments)s::integer[])
       OR (%(overflow)s AND fragment > %(max_fragment)s))
  AND due_ms <= %(until_ms)s
ORDER BY due_ms
LIMIT %(limit)s;

-- name: move_due
-- Move due rows of a worker's fragments into the reliable flow in one transaction:
-- lock them (SKIP LOCKED: another worker or node never takes the same row), delete
-- them, insert each as a message of this server's incarnation for its target channels
-- (the row's own channel for a replay, else every channel registered now), point a
-- replayed dead letter at its new message, and keep a row whose channels are all gone
-- as a dead letter. An incarnation retired by a takeover moves nothing (the owner row is
-- share-locked first, as the group commit does). Returns how many rows were taken, and
-- the messages for the in-memory channels with the row's own channel (NULL: the names are
-- every channel of the topic in this snapshot, as the group commit's answer has them) and
-- the properties (key, priority, headers) the row kept, which the message and a dead
-- letter of an orphan keep too. The ordered topics of the rows taken are locked as
-- insert_messages locks them (``serial``: the same keys, in the same order), before their
-- ids are drawn: a delayed send and a replay of an ordered topic commit one at a time
-- with its group commits, across nodes. Rows of unordered topics cost one probe of
-- dmq_topic per topic taken.
WITH owner AS MATERIALIZED (
    SELECT id FROM dmq_owner WHERE id = %(owner)s::integer AND retired_at IS NULL FOR SHARE
), due AS MATERIALIZED (
    SELECT id FROM dmq_delay
    WHERE (fragment = ANY(%(fragments)s::integer[])
           OR (%(overflow)s AND fragment > %(max_fragment)s))
      AND due_ms <= %(now_ms)s
      AND EXISTS (SELECT 1 FROM owner)
    ORDER BY due_ms, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM dmq_delay d USING due WHERE d.id = due.id
    RETURNING d.id AS delay_id, d.topic, d.channel, d.producer, d.session_id, d.produced_ms,
              d.due_ms, d.replay_of, d.body, d.key, d.priority, d.headers
), targets AS (
    SELECT mv.delay_id, array_agg(c.name ORDER BY c.name) AS names
    FROM moved mv
    JOIN dmq_channel c ON c.topic = mv.topic AND (mv.channel IS NULL OR c.name = mv.channel)
    GROUP BY mv.delay_id
), serial AS MATERIALIZED (
    -- a volatile function of the select list runs after the sort: locked in name order
    SELECT pg_advisory_xact_lock(7361004, hashtext(t.name))
    FROM dmq_topic t WHERE t.ordered AND t.name IN (SELECT topic FROM moved)
    ORDER BY t.name
), numbered AS MATERIALIZED (
    -- message ids drawn here, so the rows stored below are found again by id in
    -- an array rather than by joining the INSERT's output back to `moved`: that
    -- join is planned from row estimates, and right after many rows became due
    -- at once (a bulk replay) the estimates say one row and the plan goes quadratic
    SELECT mv.*, t.names, nextval(pg_get_serial_sequence('dmq_message', 'id')) AS message_id
    FROM moved mv JOIN targets t ON t.delay_id = mv.delay_id
    WHERE (SELECT count(*) FROM serial) >= 0  -- a one-time filter: the locks first
), ins AS (
    INSERT INTO dmq_message (id, topic, producer, session_id, produced_at, node_id, owner, channel, body,
                             key, priority, headers)
    SELECT n.message_id, n.topic, n.producer, n.session_id,
           CASE WHEN n.produced_ms BETWEEN 1 AND 253402300799999 THEN to_timestamp(n.produced_ms / 1000.0) END,
           %(node_id)s, %(owner)s::integer, n.channel, n.body, n.key, n.priority, n.headers
    FROM numbered n
    ORDER BY n.producer, n.session_id
    ON CONFLICT (producer, session_id) DO NOTHING
    RETURNING id
), placed AS (
    -- published_at defaults to now(), the same for every row of this statement
    SELECT n.message_id AS id, now() AS published_at, n.delay_id, n.topic, n.channel, n.producer,
           n.session_id, n.produced_ms, n.due_ms, n.replay_of, n.body, n.names, n.key, n.priority, n.headers
    FROM numbered n
    WHERE n.message_id = ANY (ARRAY(SELECT id FROM ins))
), replayed AS (
    UPDATE dmq_dead_letter dl SET replay_message_id = p.id
    FROM placed p WHERE dl.id = p.replay_of
), orphans AS (
    INSERT INTO dmq_dead_letter (reason, detail, topic, channel, producer, session_id, body, key, priority, headers)
    SELECT 'operator',
           CASE WHEN mv.channel IS NULL
                THEN 'topic had no registered channel when the delayed message fell due'
                ELSE 'channel ' || mv.channel || ' was not registered when the replay fell due' END,
           mv.topic, mv.channel, mv.producer, mv.session_id, mv.body, mv.key, mv.priority, mv.headers
    FROM moved mv WHERE NOT EXISTS (SELECT 1 FROM targets t WHERE t.delay_id = mv.delay_id)
)
SELECT (SELECT count(*) FROM moved) AS taken,  -- always one row, also when nothing was placed
       p.id, p.topic, p.producer, p.session_id,
       (extract(epoch FROM p.published_at) * 1000)::bigint AS published_ms,
       p.names, p.due_ms, p.body, p.channel, p.key, p.priority, p.headers
FROM (SELECT 1) AS one LEFT JOIN placed p ON true
ORDER BY p.id;

-- name: delay_stats
-- Waiting delayed messages per fragment.
SELECT fragment, count(*) AS pending, min(due_ms) AS next_due_ms, max(due_ms) AS last_due_ms
FROM dmq_delay GROUP BY fragment ORDER BY fragment;

-- name: insert_dead_letters
-- Record a batch of dead letters (rate limited sends, client reports), each with its
-- message's properties (key, priority, headers: the headers as JSON texts, NULL for none).
INSERT INTO dmq_dead_letter (reason, detail, topic, channel, producer, session_id, message_id,
                             attempts, body, published_at, key, priority, headers)
SELECT u.reason, u.detail, u.topic, u.channel, u.producer, u.session_id, u.message_id,
       u.attempts, u.body,
       CASE WHEN u.published_ms BETWEEN 1 AND 253402300799999 THEN to_timestamp(u.published_ms / 1000.0) END,
       u.key, u.priority, u.headers::jsonb
FROM unnest(%(reasons)s::text[], %(details)s::text[], %(topics)s::text[], %(channels)s::text[],
            %(producers)s::text[], %(session_ids)s::bigint[], %(message_ids)s::bigint[],
            %(attempts)s::integer[], %(bodies)b::bytea[], %(published_ms)s::bigint[],
            %(keys)s::text[], %(priorities)s::smallint[], %(headers)s::text[])
     WITH ORDINALITY AS u(reason, detail, topic, channel, producer, session_id, message_id,
                          attempts, body, published_ms, key, priority, headers, ord)
ORDER BY u.ord
RETURNING id;

-- name: record_attempts
-- Persist delivery attempts (batched), so max attempts survives a restart: the one
-- per-copy row the cursors keep, only for copies delivered more than once (or counted
-- for a topic's max_attempts), and only while the copy is not done.
INSERT INTO dmq_attempts AS a (topic, channel, message_id, attempts)
SELECT u.topic, u.channel, u.message_id, u.attempts
FROM unnest(%(topics)b::text[], %(channels)b::text[], %(owners)b::integer[], %(message_ids)b::bigint[],
            %(attempts)b::integer[]) AS u(topic, channel, owner, message_id, attempts)
JOIN dmq_channel ch ON ch.topic = u.topic AND ch.name = u.channel
LEFT JOIN dmq_cursor k ON k.topic = u.topic AND k.channel = u.channel AND k.owner = u.owner
WHERE u.message_id > coalesce(k.floor, ch.start_id) AND NOT coalesce(k.done @> u.message_id, false)
ON CONFLICT (topic, channel, message_id) DO UPDATE SET attempts = greatest(a.attempts, EXCLUDED.attempts);

-- name: exhaust_deliveries
-- Copies that used up their topic's max attempts become dead letters, with the message's
-- key, priority and headers, and are done for their channel (a copy already done is left
-- alone: one dead letter per copy). In a cluster (``fenced``) only for cursors the
-- proposing node still holds, as ack_deliveries:
-- a node that woke after its copies were taken over must not dead-letter what another
-- node now delivers. Nor a copy a seek made the channel's to deliver again since it was
-- pushed (`epochs`: the channel's epoch each copy was pushed in, as ack_deliveries).
WITH input AS (
    SELECT * FROM unnest(%(topics)b::text[], %(channels)b::text[], %(owners)b::integer[],
                         %(message_ids)b::bigint[], %(attempts)b::integer[], %(epochs)b::bigint[])
             AS u(topic, channel, owner, message_id, attempts, epoch)
), fresh AS MATERIALIZED (
    SELECT u.*, ch.start_id FROM input u
    JOIN dmq_channel ch ON ch.topic = u.topic AND ch.name = u.channel AND u.epoch >= ch.epoch
    LEFT JOIN dmq_cursor k ON k.topic = u.topic AND k.channel = u.channel AND k.owner = u.owner
    WHERE u.message_id > coalesce(k.floor, ch.start_id) AND NOT coalesce(k.done @> u.message_id, false)
), marked AS (
    INSERT INTO dmq_cursor AS k (topic, channel, owner, holder, floor, done, epoch)
    SELECT topic, channel, owner, %(holder)s::text, min(start_id), range_agg(int8range(message_id, message_id, '[]')),
           min(epoch)
    FROM fresh GROUP BY topic, channel, owner
    ON CONFLICT (topic, channel, owner) DO UPDATE SET done = k.done + EXCLUDED.done
    WHERE (NOT %(fenced)s::boolean OR k.holder = EXCLUDED.holder) AND k.epoch <= EXCLUDED.epoch
    RETURNING topic, channel, owner
), moved AS MATERIALIZED (
    SELECT f.* FROM fresh f JOIN marked k ON k.topic = f.topic AND k.channel = f.channel AND k.owner = f.owner
), kept AS (
    DELETE FROM dmq_attempts a USING moved f
    WHERE a.topic = f.topic AND a.channel = f.channel AND a.message_id = f.message_id
    RETURNING a.topic, a.channel, a.message_id, a.attempts
)
INSERT INTO dmq_dead_letter (reason, detail, topic, channel, producer, session_id, message_id,
                             attempts, body, published_at, key, priority, headers)
SELECT 'max_attempts', 'delivered ' || greatest(f.attempts, coalesce(kp.attempts, 0)) || ' times without acknowledgement',
       f.topic, f.channel, m.producer, m.session_id, m.id, greatest(f.attempts, coalesce(kp.attempts, 0)),
       m.body, m.published_at, m.key, m.priority, m.headers
FROM moved f
JOIN dmq_message m ON m.id = f.message_id
LEFT JOIN kept kp ON kp.topic = f.topic AND kp.channel = f.channel AND kp.message_id = f.message_id
RETURNING topic, channel, message_id;

-- name: open_ttl_cursors
-- Make sure every (channel, owner) of a topic with a time to live has a cursor row, so
-- that the expiry can lock it (a node delivering these copies is the owner's own node
-- until a takeover names another). Whether an owner stored a message of the topic above
-- the channel's start is one probe of the placement index per (channel, owner): its next
-- entry after (hash, owner, start), in the index's own order, which only that index gives
-- (as in claim_owners and open_ordered_cursors). An EXISTS became a semi join the planner
-- answered by hashing all of dmq_message each expiry pass (3 M retained rows: a backend
-- busy four fifths of the time, with no topic having a time to live), and a LIMIT 1 of
-- the owner's rows a walk of the table for an owner with none. Another topic of the same
-- hash counts as stored: a cursor row too many, at the channel's start, is harmless.
INSERT INTO dmq_cursor (topic, channel, owner, holder, floor)
SELECT c.topic, c.name, o.id, o.node_id, c.start_id
FROM dmq_channel c
JOIN dmq_topic t ON t.name = c.topic AND t.ttl_ms IS NOT NULL
CROSS JOIN dmq_owner o
CROSS JOIN LATERAL (SELECT hashtext(m.topic) AS h, m.owner FROM dmq_message m
                    WHERE (hashtext(m.topic), m.owner, m.id) > (hashtext(c.topic), o.id, c.start_id)
                    ORDER BY hashtext(m.topic), m.owner, m.id
                    LIMIT 1) AS stored
WHERE stored.h = hashtext(c.topic) AND stored.owner = o.id
ON CONFLICT (topic, channel, owner) DO NOTHING;

-- name: expire_deliveries
-- Copies not acknowledged within their topic's time to live -> dead letters, with the
-- message's key, priority and headers, done for their channel (bounded batch; the cursors
-- are locked SKIP LOCKED, so two nodes sweeping at once, or an ack batch under way, split
-- the work instead of doing it twice). In a cluster (``fenced``) a node takes only the
-- cursors it holds: the holder has the copies in memory and drops those it expired; a
-- copy another node expired it would go on pushing.
-- A cursor's scan takes its first waiting copies in id order, up to the limit, and the
-- time to live is tested on those, not in the scan: with the test in the scan, a pass that
-- found nothing expired read every waiting copy of the channel (106-212 ms a pass with
-- 200,000 waiting, every --expiry-interval; 4.7-8.6 ms now: bench/expiry.py). The expired copies of a channel are the head
-- of its waiting copies in id order, within one transaction's length: every storing
-- statement's published_at is its transaction's now(), taken before it draws its ids, so a
-- copy with a higher id is older than a lower one by at most the length of the transaction
-- that stored it. A copy past its time to live with a whole limit of waiting copies before
-- it, younger ones among them, waits until they have gone (that long at most).
-- The scan must be the placement index's, in its order, stopping at the limit; the planner
-- does not know the cursors' topics here, so the plan is chosen for any topic
-- (tests/integration/test_message_keys.py holds it, with statistics older and newer than
-- the topic's copies). The range is the row comparisons alone: with load_backlog's
-- equalities beside them the order reduces to the id's and the planner walked the primary
-- key from the floor, through every topic's ids. The limit is a subquery: as a constant
-- equal to or above the rows expected, the planner read the owner's whole range by a
-- bitmap heap scan and sorted it for the first 5,000 (229 ms with 200,000 waiting); a
-- limit it cannot read is taken for a tenth of the rows, where the ordered scan that stops
-- is the cheaper plan.
WITH locked AS MATERIALIZED (
    -- the done ranges copied once (as load_backlog's): a stored multirange is read again
    -- for every copy tested (bench/expiry.py --waiting 40000 --done-ranges 20000: 3.4 s a
    -- pass with this copy removed, 15 ms with it)
    SELECT k.topic, k.channel, k.owner, k.floor, k.done + '{}'::int8multirange AS done, t.ttl_ms, c.start_id
    FROM dmq_cursor k
    JOIN dmq_topic t ON t.name = k.topic AND t.ttl_ms IS NOT NULL
    JOIN dmq_channel c ON c.topic = k.topic AND c.name = k.channel
    WHERE NOT %(fenced)s::boolean OR k.holder = %(holder)s::text
    FOR UPDATE OF k SKIP LOCKED
), expired AS MATERIALIZED (
    SELECT l.topic, l.channel, l.owner, l.ttl_ms, m.id AS message_id, m.producer, m.session_id,
           m.body, m.published_at, m.key, m.priority, m.headers
    FROM locked l
    CROSS JOIN LATERAL (
        SELECT m.id, m.producer, m.session_id, m.body, m.published_at, m.key, m.priority, m.headers
        FROM dmq_message m
        WHERE (hashtext(m.topic), m.owner, m.id) > (hashtext(l.topic), l.owner, greatest(l.floor, l.start_id))
          AND (hashtext(m.topic), m.owner, m.id) <= (hashtext(l.topic), l.owner, 9223372036854775807)
          AND m.topic = l.topic
          AND (m.channel IS NULL OR m.channel = l.channel)
          AND NOT l.done @> m.id
        ORDER BY hashtext(m.topic), m.owner, m.id
        LIMIT (SELECT %(limit)s::bigint)
    ) m
    WHERE m.published_at < to_timestamp(%(now_ms)s / 1000.0) - make_interval(secs => l.ttl_ms / 1000.0)
    ORDER BY m.id
    LIMIT %(limit)s
), marked AS (
    UPDATE dmq_cursor k SET done = k.done + e.done
    FROM (SELECT topic, channel, owner, range_agg(int8range(message_id, message_id, '[]')) AS done
          FROM expired GROUP BY topic, channel, owner) e
    WHERE k.topic = e.topic AND k.channel = e.channel AND k.owner = e.owner
), kept AS (
    DELETE FROM dmq_attempts a USING expired e
    WHERE a.topic = e.topic AND a.channel = e.channel AND a.message_id = e.message_id
    RETURNING a.topic, a.channel, a.message_id, a.attempts
)
INSERT INTO dmq_dead_letter (reason, detail, topic, channel, producer, session_id, message_id,
                             attempts, body, published_at, key, priority, headers)
SELECT 'expired', 'not acknowledged within the topic''s time to live of ' || e.ttl_ms || ' ms',
       e.topic, e.channel, e.producer, e.session_id, e.message_id, coalesce(kp.attempts, 0), e.body,
       e.published_at, e.key, e.priority, e.headers
FROM expired e
LEFT JOIN kept kp ON kp.topic = e.topic AND kp.channel = e.channel AND kp.message_id = e.message_id
RETURNING topic, channel, message_id;

-- fragment: dead_letter_filter
-- The selection of every dead-letter operation (list, count, replay, delete): each
-- NULL parameter matches everything. Statements use it after WHERE, as a comment
-- holding its name between slash-stars.
(%(topic)s::text IS NULL OR topic = %(topic)s::text)
  AND (%(channel)s::text IS NULL OR channel = %(channel)s::text)
  AND (%(reason)s::text IS NULL OR reason = %(reason)s::text)
  AND (%(since_ms)s::bigint IS NULL OR dead_at >= to_timestamp(%(since_ms)s::bigint / 1000.0))
  AND (%(until_ms)s::bigint IS NULL OR dead_at < to_timestamp(%(until_ms)s::bigint / 1000.0))
  AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
  AND (%(message_ids)s::bigint[] IS NULL OR message_id = ANY(%(message_ids)s::bigint[]))
  AND (%(replayed)s::boolean IS NULL OR (replayed_at IS NOT NULL) = %(replayed)s::boolean)

-- name: list_dead_letters
-- Dead letters matching the filters (each NULL filter matches all), after a keyset cursor,
-- with their message's properties.
SELECT id, reason, detail, topic, channel, producer, session_id, message_id, attempts,
       length(body) AS size,
       (extract(epoch FROM published_at) * 1000)::bigint AS published_ms,
       (extract(epoch FROM dead_at) * 1000)::bigint AS dead_ms,
       (extract(epoch FROM replayed_at) * 1000)::bigint AS replayed_ms,
       replay_message_id, key, priority, headers
FROM dmq_dead_letter
WHERE /*dead_letter_filter*/
  AND id > %(after)s
ORDER BY id
LIMIT %(limit)s;

-- name: count_dead_letters
-- How many dead letters match the filters (progress totals), and how many are not yet replayed.
SELECT count(*), count(*) FILTER (WHERE replayed_at IS NULL)
FROM dmq_dead_letter
WHERE /*dead_letter_filter*/;

-- name: show_dead_letter
-- One dead letter with its properties and its body.
SELECT id, reason, detail, topic, channel, producer, session_id, message_id, attempts,
       length(body) AS size,
       (extract(epoch FROM published_at) * 1000)::bigint AS published_ms,
       (extract(epoch FROM dead_at) * 1000)::bigint AS dead_ms,
       (extract(epoch FROM replayed_at) * 1000)::bigint AS replayed_ms,
       replay_message_id, key, priority, headers, body
FROM dmq_dead_letter WHERE id = %(id)s;

-- name: replay_dead_letters
-- Replay one batch (keyset after `after`): mark the dead letters replayed and queue
-- each, due now, in dmq_delay for its own channel (NULL: every channel) in the same
-- transaction. Producer 'dmq-replay' with session id = the dead letter's id makes a
-- second replay of the same dead letter a no-op even if the mark were lost. Returns
-- the highest id looked at (the next cursor) and how many were queued. The dead letters
-- of a topic placed on another cluster (moved away) are left: queued here, they would
-- be stored where no channel of the topic drains. The queued row keeps the letter's key,
-- priority and headers, which move_due gives the message it stores.
WITH picked AS MATERIALIZED (
    SELECT id FROM dmq_dead_letter
    WHERE /*dead_letter_filter*/
      AND replayed_at IS NULL
      AND id > %(after)s
      AND NOT EXISTS (SELECT 1 FROM dmq_topic t JOIN dmq_cluster_self s ON s.name <> t.cluster
                      WHERE t.name = dmq_dead_letter.topic)
    ORDER BY id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), marked AS (
    UPDATE dmq_dead_letter dl SET replayed_at = now()
    FROM picked WHERE dl.id = picked.id
    RETURNING dl.id, dl.topic, dl.channel, dl.body, dl.key, dl.priority, dl.headers
), queued AS (
    INSERT INTO dmq_delay (fragment, due_ms, topic, channel, producer, session_id, replay_of,
                           node_id, body, key, priority, headers)
    SELECT 1 + mod(m.id, %(fragments)s), %(now_ms)s, m.topic, m.channel, 'dmq-replay', m.id, m.id,
           %(node_id)s, m.body, m.key, m.priority, m.headers
    FROM marked m
    ON CONFLICT (producer, session_id) DO NOTHING
    RETURNING id
)
SELECT (SELECT max(id) FROM picked), (SELECT count(*) FROM queued);

-- name: delete_dead_letters
-- Delete one batch of matching dead letters (keyset after `after`); returns the ids.
DELETE FROM dmq_dead_letter
WHERE id IN (
    SELECT id FROM dmq_dead_letter
    WHERE /*dead_letter_filter*/
      AND id > %(after)s
    ORDER BY id
    LIMIT %(limit)s
)
RETURNING id;

-- name: dead_letter_counts
-- Dead letters per reason, and how many of them were replayed.
SELECT reason, count(*), count(replayed_at) FROM dmq_dead_letter GROUP BY reason ORDER BY reason;

-- name: log_admin_operation
-- Audit one destructive admin operation.
INSERT INTO dmq_admin_log (surface, actor, operation, filters, affected)
VALUES (%(surface)s, %(actor)s, %(operation)s, %(filters)s, %(affected)s);

-- ---------------------------------------------------------------------------
-- Cluster: ZooKeeper registry mirror, owned backlog, takeover
-- ---------------------------------------------------------------------------

-- name: lock_registry_mirror
-- Serialise nodes copying ZooKeeper's topics and channels into dmq_topic/dmq_channel.
SELECT pg_advisory_xact_lock(7361002);

-- name: upsert_topic
-- Register a topic or replace its settings (the registry mirror; the registry decides), but
-- never with an older version than the row holds (0019): a node with a stale view must not
-- undo a move's fence. Returns nothing when the row was newer and stays.
INSERT INTO dmq_topic (name, store, msg_timeout_ms, rate_limit, ttl_ms, max_attempts, cluster, draining, ordered,
                       retention_ms, registry_epoch, version)
VALUES (%(name)s, %(store)s, %(msg_timeout_ms)s, %(rate_limit)s, %(ttl_ms)s, %(max_attempts)s,
        %(cluster)s, %(draining)s, %(ordered)s, %(retention_ms)s, %(registry_epoch)s, %(version)s)
ON CONFLICT (name) DO UPDATE
SET store = EXCLUDED.store, msg_timeout_ms = EXCLUDED.msg_timeout_ms,
    rate_limit = EXCLUDED.rate_limit, ttl_ms = EXCLUDED.ttl_ms,
    max_attempts = EXCLUDED.max_attempts, cluster = EXCLUDED.cluster, draining = EXCLUDED.draining,
    ordered = EXCLUDED.ordered, retention_ms = EXCLUDED.retention_ms, registry_epoch = EXCLUDED.registry_epoch, version = EXCLUDED.version
WHERE (dmq_topic.registry_epoch, dmq_topic.version) <= (EXCLUDED.registry_epoch, EXCLUDED.version)
RETURNING name;

-- name: create_owner
-- A new incarnation of this node: the owner of the messages it stores from now on.
INSERT INTO dmq_owner (node_id) VALUES (%(node_id)s) RETURNING id;

-- name: retire_silent_owners
-- Servers without ZooKeeper: every earlier incarnation of this node, and every incarnation
-- whose server has not beaten for `silent_s`, is over (and fenced: a process still running
-- one can store nothing more); the servers deliver their copies.
UPDATE dmq_owner SET retired_at = now()
WHERE retired_at IS NULL AND id <> %(owner)s::integer
  AND (node_id = %(node_id)s OR seen_at < now() - make_interval(secs => %(silent_s)s))
RETURNING id;

-- name: owner_heartbeat
-- This incarnation is alive; no row if it was retired (another server took it over).
UPDATE dmq_owner SET seen_at = now() WHERE id = %(owner)s::integer AND retired_at IS NULL
RETURNING id;

-- name: owner_states
-- Every incarnation, its node and whether it was retired (a retired owner stores nothing
-- more, so its holder may treat everything it loaded as complete).
SELECT id, node_id, retired_at IS NOT NULL FROM dmq_owner ORDER BY id;

-- name: takeover_candidates
-- Nodes with incarnations still storing, and nodes named as holders of cursors, each with
-- its incarnations not yet retired: the takeover compares them with the live nodes. The
-- holders of ordered topics' cursors are not named: a takeover leaves those to the
-- topic's orderer (claim_owners), so a departed orderer would be named again and again.
SELECT n.node_id,
       coalesce((SELECT array_agg(o.id ORDER BY o.id) FROM dmq_owner o
                 WHERE o.node_id = n.node_id AND o.retired_at IS NULL), '{}')
FROM (SELECT node_id FROM dmq_owner WHERE retired_at IS NULL
      UNION SELECT holder FROM dmq_cursor k
            WHERE NOT EXISTS (SELECT 1 FROM dmq_topic t WHERE t.name = k.topic AND t.ordered)) AS n
ORDER BY n.node_id;

-- name: claim_owners
-- Takeover (holding the departed node's lock in ZooKeeper): retire its incarnations that
-- are not live (their group commits wait for or fail on the owner row's lock, so nothing
-- more is stored for them), open their cursors on every channel with their messages, and
-- become the holder of every cursor of those owners, or held by the departed node, that
-- no live node holds. Returns the channels whose cursors changed hands. An ordered
-- topic's channels are left alone (issue 45): one node at a time delivers the topic, its
-- orderer, which holds every cursor of it (claim_ordered_cursors; after a departed
-- orderer, the next one's claim moves them); opened or moved here, they would go to a
-- node that does not deliver the topic, and the orderer's acks would be refused forever.
WITH retired AS (
    UPDATE dmq_owner SET retired_at = now()
    WHERE id = ANY(%(owners)s::integer[]) AND retired_at IS NULL
    RETURNING id
), opened AS (
    INSERT INTO dmq_cursor (topic, channel, owner, holder, floor)
    SELECT c.topic, c.name, o.id, %(me)s, c.start_id
    FROM dmq_channel c JOIN dmq_topic t ON t.name = c.topic AND NOT t.ordered
    CROSS JOIN unnest(%(owners)s::integer[]) AS o(id)
    CROSS JOIN LATERAL (SELECT hashtext(m.topic) AS h, m.owner FROM dmq_message m
                        WHERE (hashtext(m.topic), m.owner, m.id) > (hashtext(c.topic), o.id, c.start_id)
                        ORDER BY hashtext(m.topic), m.owner, m.id
                        LIMIT 1) AS stored
    WHERE stored.h = hashtext(c.topic) AND stored.owner = o.id
    ON CONFLICT (topic, channel, owner) DO NOTHING
    RETURNING topic, channel
), moved AS (
    UPDATE dmq_cursor k SET holder = %(me)s
    WHERE (k.owner = ANY(%(owners)s::integer[]) OR k.holder = %(dead)s)
      AND k.holder <> %(me)s AND NOT (k.holder = ANY(%(live)s::text[]))
      AND NOT EXISTS (SELECT 1 FROM dmq_topic t WHERE t.name = k.topic AND t.ordered)
    RETURNING topic, channel
)
SELECT topic, channel, count(*)
FROM (SELECT * FROM opened UNION ALL SELECT * FROM moved) AS changed
GROUP BY topic, channel ORDER BY topic, channel;

-- name: open_ordered_cursors
-- An orderer's claim of an ordered topic, its first half (db.orderer_steps, issue 45): a
-- cursor held by the orderer (``me``), at its channel's start, for each channel of the
-- topic and each incarnation with messages of the topic there, where there is none (as
-- claim_owners opens a departed node's). Without it, the first ack of such a copy would
-- open its cursor for whichever node sent it, the previous orderer included. Returns how
-- many cursors it opened (a row count).
INSERT INTO dmq_cursor (topic, channel, owner, holder, floor)
SELECT c.topic, c.name, o.id, %(me)s, c.start_id
FROM dmq_channel c CROSS JOIN dmq_owner o
CROSS JOIN LATERAL (SELECT hashtext(m.topic) AS h, m.owner FROM dmq_message m
                    WHERE (hashtext(m.topic), m.owner, m.id) > (hashtext(c.topic), o.id, c.start_id)
                    ORDER BY hashtext(m.topic), m.owner, m.id
                    LIMIT 1) AS stored
WHERE c.topic = %(topic)s AND stored.h = hashtext(c.topic) AND stored.owner = o.id
ON CONFLICT (topic, channel, owner) DO NOTHING;

-- name: claim_ordered_cursors
-- The claim's second half: the orderer becomes the holder of every other cursor of the
-- topic. A statement of its own, so that its snapshot sees a cursor that another node's
-- ack opened while open_ordered_cursors ran (which waited for that ack and left its
-- row). ack_deliveries and exhaust_deliveries check the holder on the row as locked, so
-- from this commit on the previous orderer's fenced acks and exhausts move none of the
-- topic's cursors, also ones it sends after a freeze. Returns the previous holder of each
-- cursor it moved (the orderer waits out a handover from a node that did not let go).
UPDATE dmq_cursor k SET holder = %(me)s
FROM (SELECT topic, channel, owner, holder FROM dmq_cursor
      WHERE topic = %(topic)s AND holder IS DISTINCT FROM %(me)s
      FOR UPDATE) old
WHERE k.topic = old.topic AND k.channel = old.channel AND k.owner = old.owner
RETURNING old.holder;

-- name: release_ordered_cursors
-- A topic no longer ordered: its orderer (``me``) gives each cursor of it that it holds
-- back to the node of the cursor's incarnation (dmq_owner.node_id) when that incarnation
-- is live (not retired), so the node that stored the copies delivers them again, as it
-- does an unordered topic's (and a takeover claims them if that node has departed). A
-- retired incarnation's cursors stay with ``me``. Returns how many changed hands.
UPDATE dmq_cursor k SET holder = o.node_id
FROM dmq_owner o
WHERE k.topic = %(topic)s AND k.holder = %(me)s AND o.id = k.owner
  AND o.retired_at IS NULL AND o.node_id <> %(me)s;

-- name: prune_owners
-- Incarnations retired long enough that none of their messages is left, with their
-- cursors; and kept attempts of copies that are done (an ack racing a redelivery).
-- Whether an incarnation has a message left: per topic, the placement index's next entry
-- after (the topic's hash, the incarnation) is one of theirs (as claim_owners asks: another
-- topic of the same hash keeps an incarnation, harmlessly). With ``m.owner = o.id`` the
-- planner walked dmq_message until a row of the owner turned up: all 10 M retained rows,
-- 1.5 s a sweep pass, for an incarnation whose rows are the newest.
WITH gone AS (
    DELETE FROM dmq_owner o
    WHERE o.retired_at IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM dmq_topic t
                      CROSS JOIN LATERAL (SELECT hashtext(m.topic) AS h, m.owner FROM dmq_message m
                                          WHERE (hashtext(m.topic), m.owner, m.id) > (hashtext(t.name), o.id, 0)
                                          ORDER BY hashtext(m.topic), m.owner, m.id
                                          LIMIT 1) AS stored
                      WHERE stored.h = hashtext(t.name) AND stored.owner = o.id)
    RETURNING o.id
), cursors AS (
    DELETE FROM dmq_cursor k USING gone WHERE k.owner = gone.id
)
DELETE FROM dmq_attempts a
WHERE NOT EXISTS (SELECT 1 FROM dmq_pending p
                  WHERE p.topic = a.topic AND p.channel = a.channel AND p.message_id = a.message_id);

-- name: backends_alive
-- Which of these PostgreSQL backends still run (a write whose answer was lost is settled
-- once the backend that ran it is gone: committed or rolled back, and visible either way).
SELECT pid FROM pg_stat_activity WHERE pid = ANY(%(pids)s::integer[]);

-- name: owner_depths
-- Unacknowledged copies per node delivering them (cluster view for `dmq stats` and operators).
SELECT holder, count(*) AS copies FROM dmq_pending GROUP BY holder ORDER BY holder;

-- name: channel_pauses
-- Reliable channels an operator paused (read with the stored depths on a timer).
SELECT topic, channel FROM dmq_channel_pause;

-- name: channel_epochs
-- The channels ever sought, with their epoch (read with the pauses on a timer: a node
-- learns of a seek made elsewhere, and reads the channel again).
SELECT topic, name, epoch FROM dmq_channel WHERE epoch > 0;

-- name: pause_channel
INSERT INTO dmq_channel_pause (topic, channel) VALUES (%(topic)s, %(channel)s)
ON CONFLICT DO NOTHING;

-- name: unpause_channel
DELETE FROM dmq_channel_pause WHERE topic = %(topic)s AND channel = %(channel)s;

-- name: empty_channel
-- nsqd's channel empty on a reliable channel: every stored, unacknowledged copy of the
-- channel is dropped (the messages stay for the other channels): each owner's cursor
-- moves to its last message stored now. Returns how many copies were waiting.
WITH ch AS (
    SELECT topic, name, start_id FROM dmq_channel WHERE topic = %(topic)s AND name = %(channel)s
), tops AS (
    SELECT o.id AS owner, o.node_id,
           (SELECT max(m.id) FROM dmq_message m
            WHERE hashtext(m.topic) = hashtext(ch.topic) AND m.topic = ch.topic AND m.owner = o.id) AS top
    FROM ch CROSS JOIN dmq_owner o
), waiting AS (
    SELECT count(*) AS n FROM dmq_pending p WHERE p.topic = %(topic)s AND p.channel = %(channel)s
), moved AS (
    INSERT INTO dmq_cursor AS k (topic, channel, owner, holder, floor)
    SELECT ch.topic, ch.name, t.owner, t.node_id, greatest(t.top, ch.start_id)
    FROM ch JOIN tops t ON t.top IS NOT NULL
    ON CONFLICT (topic, channel, owner) DO UPDATE
    SET floor = greatest(k.floor, EXCLUDED.floor),
        done = k.done - int8multirange(int8range(NULL, greatest(k.floor, EXCLUDED.floor), '(]'))
), kept AS (
    DELETE FROM dmq_attempts WHERE topic = %(topic)s AND channel = %(channel)s
)
SELECT n FROM waiting;

-- ---------------------------------------------------------------------------
-- The message trace, peeking, and the gauges /metrics reads on a timer (schema version 6)
-- ---------------------------------------------------------------------------

-- name: record_returns
-- Deliveries that came back unacknowledged (batched; reliable/trace.py).
INSERT INTO dmq_trace (message_id, topic, channel, attempt, reason, consumer, node_id,
                       delivered_at, returned_at)
SELECT u.message_id, u.topic, u.channel, u.attempt, u.reason, u.consumer, %(node_id)s,
       to_timestamp(u.delivered_ms / 1000.0), to_timestamp(u.returned_ms / 1000.0)
FROM unnest(%(message_ids)b::bigint[], %(topics)b::text[], %(channels)b::text[],
            %(attempts)b::integer[], %(reasons)b::text[], %(consumers)b::text[],
            %(delivered_ms)b::bigint[], %(returned_ms)b::bigint[])
     AS u(message_id, topic, channel, attempt, reason, consumer, delivered_ms, returned_ms);

-- name: sweep_trace
-- Drop returns older than the trace retention (bounded batch).
DELETE FROM dmq_trace
WHERE id IN (SELECT id FROM dmq_trace
             WHERE returned_at < now() - make_interval(secs => %(retention_s)s)
             ORDER BY returned_at LIMIT %(limit)s);

-- name: trace_stored
-- The stored message (or its copy kept for the archive after the sweep), body cut short,
-- with its properties (key, priority, headers: schema 16).
SELECT id, topic, producer, session_id,
       (extract(epoch FROM produced_at) * 1000)::bigint,
       (extract(epoch FROM published_at) * 1000)::bigint,
       node_id, length(body), substring(body FOR %(preview)s), false AS swept, key, priority, headers
FROM dmq_message WHERE id = %(id)s
UNION ALL
SELECT id, topic, producer, session_id,
       (extract(epoch FROM produced_at) * 1000)::bigint,
       (extract(epoch FROM published_at) * 1000)::bigint,
       node_id, length(body), substring(body FOR %(preview)s), true, key, priority, headers
FROM dmq_message_history WHERE id = %(id)s;

-- name: trace_pending
-- The message's copies not yet acknowledged, and the node delivering each.
SELECT channel, attempts, holder FROM dmq_pending
WHERE topic = %(topic)s AND message_id = %(id)s
ORDER BY channel;

-- name: trace_returns
-- Deliveries of the message that came back unacknowledged.
SELECT channel, attempt, reason, consumer, node_id,
       (extract(epoch FROM delivered_at) * 1000)::bigint,
       (extract(epoch FROM returned_at) * 1000)::bigint
FROM dmq_trace WHERE message_id = %(id)s ORDER BY returned_at, id;

-- name: trace_acks
-- The message's acknowledged copies.
SELECT topic, channel, attempts, consumer,
       (extract(epoch FROM published_at) * 1000)::bigint,
       (extract(epoch FROM first_delivered_at) * 1000)::bigint,
       (extract(epoch FROM delivered_at) * 1000)::bigint,
       (extract(epoch FROM acked_at) * 1000)::bigint
FROM dmq_delivery_log
-- a batch's lowest and highest message id are what its BRIN index summarises
WHERE ack_batch_low <= %(id)s AND ack_batch_high >= %(id)s AND message_id = %(id)s
ORDER BY acked_at, id;

-- name: trace_dead_letters
-- Dead letters made of the message's copies, and the one it replays (a replay is stored by
-- producer dmq-replay with the dead letter's id as its session id).
SELECT id, reason, detail, topic, channel, attempts,
       (extract(epoch FROM dead_at) * 1000)::bigint,
       (extract(epoch FROM replayed_at) * 1000)::bigint,
       replay_message_id, message_id
FROM dmq_dead_letter
WHERE message_id = %(id)s OR id = %(replay_of)s
ORDER BY id;

-- name: trace_delayed
-- A delay entry (a DELAY send's id names its entry until it falls due), with the
-- properties its message will have.
SELECT id, topic, channel, producer, session_id, due_ms, fragment, node_id,
       (extract(epoch FROM created_at) * 1000)::bigint, length(body),
       substring(body FOR %(preview)s), replay_of, key, priority, headers
FROM dmq_delay WHERE id = %(id)s;

-- name: find_message_by_session
-- A stored message's id from its producer and session id.
SELECT id FROM dmq_message WHERE producer = %(producer)s AND session_id = %(session_id)s
UNION ALL
SELECT id FROM dmq_message_history WHERE producer = %(producer)s AND session_id = %(session_id)s
LIMIT 1;

-- name: peek_channel
-- A channel's stored, unacknowledged copies in id order, bodies cut short, with their
-- messages' properties; nothing changes.
SELECT p.message_id, p.attempts, p.holder, m.producer, m.session_id,
       (extract(epoch FROM m.published_at) * 1000)::bigint,
       length(m.body), substring(m.body FOR %(preview)s), m.key, m.priority, m.headers
FROM dmq_pending p JOIN dmq_message m ON m.id = p.message_id
WHERE p.topic = %(topic)s AND p.channel = %(channel)s AND p.message_id > %(after)s
ORDER BY p.message_id
LIMIT %(limit)s;

-- name: published_at
-- The publish times of some stored messages (each channel's lowest unacknowledged id, from
-- the depth count's last pass): the oldest unacknowledged message's age for /metrics.
SELECT id, (extract(epoch FROM published_at) * 1000)::bigint FROM dmq_message WHERE id = ANY(%(ids)s::bigint[]);

-- name: delay_pending_by_topic
-- Delayed messages waiting, per topic, and the next due time.
SELECT topic, count(*), min(due_ms) FROM dmq_delay GROUP BY topic ORDER BY topic;

-- name: delay_due_histogram
-- Waiting delayed messages by due time: counts per bucket of %(width_ms)s from now.
SELECT greatest(0, (due_ms - %(now_ms)s) / %(width_ms)s)::bigint AS bucket, count(*)
FROM dmq_delay
WHERE (%(topic)s::text IS NULL OR topic = %(topic)s)
GROUP BY 1 ORDER BY 1;

-- name: list_delayed
-- Waiting delayed messages by due time (keyset on (due_ms, id)), bodies cut short, with
-- their properties.
SELECT id, topic, channel, producer, session_id, due_ms, fragment, length(body),
       substring(body FOR %(preview)s), replay_of, key, priority, headers
FROM dmq_delay
WHERE (%(topic)s::text IS NULL OR topic = %(topic)s)
  AND (due_ms, id) > (%(after_due)s, %(after_id)s)
ORDER BY due_ms, id
LIMIT %(limit)s;

-- name: deliver_delayed_now
-- Make delay entries due at once (the delay workers move them at their next poll).
UPDATE dmq_delay SET due_ms = %(now_ms)s WHERE id = ANY(%(ids)s::bigint[]) AND due_ms > %(now_ms)s
RETURNING id;

-- name: cancel_delayed
-- Delete delay entries before they fall due.
DELETE FROM dmq_delay WHERE id = ANY(%(ids)s::bigint[]) RETURNING id;

-- name: list_admin_log
-- The admin audit log, newest first.
SELECT id, (extract(epoch FROM at) * 1000)::bigint, surface, actor, operation, filters, affected
FROM dmq_admin_log WHERE id < %(before)s ORDER BY id DESC LIMIT %(limit)s;

-- ---------------------------------------------------------------------------
-- Several PostgreSQL clusters (schema version 8)
-- ---------------------------------------------------------------------------

-- name: lock_clusters
-- Serialise nodes assigning id slots to cluster names (on the main cluster).
SELECT pg_advisory_xact_lock(7361003);

-- name: list_clusters
-- Every cluster's name and id slot, as recorded on the main cluster.
SELECT name, slot FROM dmq_cluster ORDER BY slot;

-- name: add_cluster
-- Give a new cluster name the lowest free id slot (under lock_clusters).
INSERT INTO dmq_cluster (name, slot)
SELECT %(name)s, min(s) FROM generate_series(0, 31) AS s
WHERE s NOT IN (SELECT slot FROM dmq_cluster)
HAVING min(s) IS NOT NULL
ON CONFLICT (name) DO NOTHING
RETURNING slot;

-- name: cluster_self
-- Which cluster this database is.
SELECT name, slot, claimed FROM dmq_cluster_self;

-- name: claim_cluster_self
-- Name this database as a cluster, once (a claimed database keeps its name).
UPDATE dmq_cluster_self SET name = %(name)s, slot = %(slot)s, claimed = true
WHERE NOT claimed OR (name = %(name)s AND slot = %(slot)s)
RETURNING name;

-- name: raise_id_sequences
-- Move the id sequences of messages, delayed messages and dead letters into this
-- cluster's slot (no-op once there).
SELECT setval(s.seq, %(floor)s, false)
FROM (VALUES (pg_get_serial_sequence('dmq_message', 'id')), (pg_get_serial_sequence('dmq_delay', 'id')),
             (pg_get_serial_sequence('dmq_dead_letter', 'id'))) AS s(seq)
WHERE coalesce(pg_sequence_last_value(s.seq::regclass), 0) < %(floor)s;

-- name: topic_leftovers
-- What a topic still has on this cluster: where this database says it is placed, copies
-- waiting and delayed messages (a move drains the old cluster until both are 0), the
-- transactions that began before the move's fence (one of them may still store a message
-- of the topic here: its statement read the old placement) and the time now (the next
-- fence's).
SELECT (SELECT cluster FROM dmq_topic WHERE name = %(name)s) AS placed,
       (SELECT count(*) FROM dmq_pending WHERE topic = %(name)s) AS pending,
       (SELECT count(*) FROM dmq_delay WHERE topic = %(name)s) AS delayed,
       (SELECT count(*) FROM pg_stat_activity
        WHERE datname = current_database() AND pid <> pg_backend_pid()
          AND xact_start < %(fenced_at)s::timestamptz) AS older,
       now() AS now;

-- name: consumed_states
-- What each channel did with each message a producer asked to be told about (SEND_CONSUMED_ACK,
-- docs/protocol.md §4.14): one row per (message, channel registered for the message's topic
-- when it was stored, or the one channel a replay was stored for), 'waiting' until the
-- channel's cursor covers the id, then 'dead' if the channel dead-lettered the copy, else
-- 'acked'. A message the retention sweep already removed had every copy done: its channels
-- are those registered before its id. Read by the node that stored the messages, a few times
-- a second while some are watched; the cursors are per owner, so it answers whichever node
-- pushed and acknowledged the copies (a takeover's too).
WITH w AS (
    SELECT w.message_id, w.topic, m.owner, m.channel AS only_channel, m.id IS NOT NULL AS stored
    FROM unnest(%(ids)s::bigint[], %(topics)s::text[]) AS w(message_id, topic)
    LEFT JOIN dmq_message m ON m.id = w.message_id
), copies AS (
    SELECT w.message_id, c.topic, c.name AS channel,
           NOT w.stored OR EXISTS (
               SELECT 1 FROM dmq_cursor k
               WHERE k.topic = c.topic AND k.channel = c.name AND k.owner = w.owner
                 AND (k.floor >= w.message_id OR k.done @> w.message_id)) AS done
    FROM w JOIN dmq_channel c ON c.topic = w.topic AND c.start_id < w.message_id
                             AND (w.only_channel IS NULL OR w.only_channel = c.name)
)
SELECT p.message_id, p.channel,
       CASE WHEN NOT p.done THEN 'waiting'
            WHEN EXISTS (SELECT 1 FROM dmq_dead_letter d
                         WHERE d.topic = p.topic AND d.channel = p.channel AND d.message_id = p.message_id)
            THEN 'dead'
            ELSE 'acked' END AS state
FROM copies p
ORDER BY p.message_id, p.channel;

-- ---------------------------------------------------------------------------
-- Seek (issue 46): move a channel to a time, an id or the latest message
-- ---------------------------------------------------------------------------

-- name: seek_lock
-- A seek of a topic's channel, alone: the topic's retention sweep holds this lock shared,
-- so no retained row at or after the target is swept between the count and the cursors'
-- write (and two seeks of one topic take turns).
SELECT pg_advisory_xact_lock(7361005, hashtext(%(topic)s::text));

-- name: seek_state
-- What a seek is checked against, one row: whether the channel is registered, the topic's
-- time to live, what the retention sweep removed of it (swept_id, swept_ms: nothing kept
-- was published at or before swept_ms), the time now (ms), and the topic's lowest stored id
-- with its publish time (one descent of the topic index per incarnation); and where the
-- database is archived (dmq-pipeline archive; NULL: never), for a seek --from-archive.
SELECT EXISTS (SELECT 1 FROM dmq_channel WHERE topic = %(topic)s AND name = %(channel)s),
       (SELECT ttl_ms FROM dmq_topic WHERE name = %(topic)s),
       r.swept_id, r.swept_ms, (extract(epoch FROM now()) * 1000)::bigint,
       f.id, (extract(epoch FROM f.published_at) * 1000)::bigint,
       (SELECT location FROM dmq_archive_state)
FROM (SELECT 1) AS one
LEFT JOIN dmq_retention r ON r.topic = %(topic)s
LEFT JOIN LATERAL (
    SELECT m.id, m.published_at FROM dmq_owner o
    CROSS JOIN LATERAL (SELECT m.id, m.published_at FROM dmq_message m
                        WHERE hashtext(m.topic) = hashtext(%(topic)s::text) AND m.topic = %(topic)s
                          AND (m.owner, m.id) >= (o.id, 0) AND (m.owner, m.id) <= (o.id, 9223372036854775807)
                        ORDER BY m.owner, m.id LIMIT 1) m
    ORDER BY m.id LIMIT 1
) f ON true;

-- name: seek_ends
-- The lowest and highest stored id (of any topic): where the search of a time begins.
SELECT min(id), max(id) FROM dmq_message;

-- name: seek_probe
-- One step of the search of a time (db.seek.seek_bounds_steps): for each point, the first
-- stored message (of any topic) at or after it, and its publish time in microseconds (a
-- probe of the primary key each: dmq_message has no index on published_at).
SELECT p.at, f.id, (extract(epoch FROM f.published_at) * 1000000)::bigint
FROM unnest(%(at)s::bigint[]) WITH ORDINALITY AS p(at, n)
LEFT JOIN LATERAL (SELECT m.id, m.published_at FROM dmq_message m WHERE m.id >= p.at ORDER BY m.id LIMIT 1) f
       ON true
ORDER BY p.n;

-- name: seek_channel
-- Seek a channel (db.seek.seek_channel_steps, under seek_lock): every incarnation's cursor
-- of the channel is written anew up to what this statement read (its top): every id up to
-- its floor F_o is done, and the ids of ``done`` above it; above the top the cursor keeps
-- what it has (messages committed after the snapshot, acknowledged meanwhile, are not the
-- seek's); the channel's epoch rises (a node's acknowledgement of a copy
-- pushed before is refused by it) and its start_id comes down to the lowest floor, so what
-- was stored before the channel was registered is its own too. The floors: each
-- incarnation's highest id of the topic (``latest``: nothing waits; one without rows keeps
-- the channel's start), else ``floor`` for all. The done ranges: with ``before_ms``, each
-- incarnation's ids of the topic in (floor, window_hi) published before that time, read
-- from the topic index over that window only (a seek to a time: below the floor everything
-- was published before it, from window_hi on nothing was). A new cursor row is held by the
-- node holding that incarnation's cursor of another channel of the topic (an ordered
-- topic's orderer), else any cursor of it, else its own node: load_backlog loads the
-- copies of the cursors a node holds, and a holder that is gone would strand them (a
-- takeover moves a departed holder's). Attempts kept above the lowest floor go: a replayed
-- copy starts at 0. With ``dry_run`` nothing is written: the same answer, epoch NULL.
-- ``fresh``: the channel's row was inserted by this transaction (dmq channel add --start-*),
-- so no node has read it or pushed a copy of it: its epoch stays (a node that opens it
-- reads these cursors, and would deliver everything twice if it then learned of a new epoch).
-- Returns one row, none when the channel is not registered: the copies the channel has to
-- deliver right after the seek (the dmq_pending rule, ids up to ``top``, the topic's
-- highest id read), top, the lowest of those ids and its publish time (ms), the new
-- epoch, and the lowest copy waiting before the seek with its publish time.
-- The reads of an incarnation's rows bound ``(owner, id)`` as a row, and order by those
-- columns: only the topic index (hashtext(topic), owner, id) takes such bounds as its range
-- and gives that order, so the planner does not walk the primary key through other topics'
-- rows instead (it did, filtering, for an incarnation with no row of the topic: 200,000 rows
-- read for none). The index stops at a row bound's first column only (the owner: PostgreSQL
-- 15), so the upper bounds are the incarnation's top, above which nothing is stored; the
-- done ranges' window, bounded above by an id in the middle, keeps plain bounds.
WITH ch AS MATERIALIZED (
    SELECT c.start_id FROM dmq_channel c WHERE c.topic = %(topic)s AND c.name = %(channel)s
), tops AS MATERIALIZED (
    SELECT o.id AS owner, o.node_id,
           (SELECT m.id FROM dmq_message m
            WHERE hashtext(m.topic) = hashtext(%(topic)s::text) AND m.topic = %(topic)s
              AND (m.owner, m.id) >= (o.id, 0) AND (m.owner, m.id) <= (o.id, 9223372036854775807)
            ORDER BY m.owner DESC, m.id DESC LIMIT 1) AS top
    FROM ch CROSS JOIN dmq_owner o
), plan AS MATERIALIZED (
    SELECT t.owner, t.node_id, f.floor, greatest(coalesce(t.top, 0), f.floor) AS kept,
           coalesce((SELECT range_agg(int8range(m.id, m.id, '[]')) FROM dmq_message m
                     WHERE %(before_ms)s::bigint IS NOT NULL
                       AND hashtext(m.topic) = hashtext(%(topic)s::text) AND m.topic = %(topic)s
                       AND m.owner = t.owner
                       AND (hashtext(m.topic), m.owner, m.id) > (hashtext(%(topic)s::text), t.owner, f.floor)
                       AND (hashtext(m.topic), m.owner, m.id)
                           <= (hashtext(%(topic)s::text), t.owner, least(t.top, %(window_hi)s::bigint - 1))
                       AND m.published_at < timestamptz 'epoch' + %(before_ms)s::bigint * interval '1 millisecond'),
                    '{}'::int8multirange) AS done
    FROM ch CROSS JOIN tops t
    CROSS JOIN LATERAL (SELECT CASE WHEN %(latest)s::boolean THEN coalesce(t.top, ch.start_id)
                                    ELSE %(floor)s::bigint END AS floor) f
), bounds AS MATERIALIZED (
    SELECT (SELECT max(top) FROM tops) AS top,
           coalesce((SELECT min(floor) FROM plan), CASE WHEN %(latest)s::boolean THEN ch.start_id
                                                        ELSE %(floor)s::bigint END) AS floor
    FROM ch
), counted AS MATERIALIZED (
    -- per incarnation one range of the topic index, (floor, top] (OFFSET 0 keeps the
    -- subquery apart, so the bounds reach the index instead of a join filtering its rows)
    SELECT count(*) AS copies, min(m.id) AS first
    FROM plan p CROSS JOIN bounds b
    CROSS JOIN LATERAL (
        SELECT m.id FROM dmq_message m
        WHERE hashtext(m.topic) = hashtext(%(topic)s::text) AND m.topic = %(topic)s
          AND (m.owner, m.id) > (p.owner, p.floor) AND (m.owner, m.id) <= (p.owner, b.top)
          AND (m.channel IS NULL OR m.channel = %(channel)s) AND NOT p.done @> m.id
        OFFSET 0
    ) m
), cursors AS MATERIALIZED (
    -- the cursors as they were, their done ranges read once (load_backlog says why)
    SELECT k.owner, k.floor, k.done + '{}'::int8multirange AS done FROM dmq_cursor k
    WHERE k.topic = %(topic)s AND k.channel = %(channel)s
), previous AS MATERIALIZED (
    SELECT min(w.id) AS id
    FROM ch CROSS JOIN tops t
    LEFT JOIN cursors k ON k.owner = t.owner
    CROSS JOIN LATERAL (
        SELECT m.id FROM dmq_message m
        WHERE hashtext(m.topic) = hashtext(%(topic)s::text) AND m.topic = %(topic)s
          AND (m.owner, m.id) > (t.owner, greatest(ch.start_id, coalesce(k.floor, ch.start_id)))
          AND (m.owner, m.id) <= (t.owner, t.top)
          AND (m.channel IS NULL OR m.channel = %(channel)s) AND NOT coalesce(k.done @> m.id, false)
        ORDER BY m.owner, m.id LIMIT 1
    ) w
), bumped AS (
    UPDATE dmq_channel c SET epoch = c.epoch + CASE WHEN %(fresh)s::boolean THEN 0 ELSE 1 END,
                             start_id = least(c.start_id, b.floor)
    FROM bounds b
    WHERE c.topic = %(topic)s AND c.name = %(channel)s AND NOT %(dry_run)s::boolean
    RETURNING c.epoch
), written AS (
    INSERT INTO dmq_cursor AS k (topic, channel, owner, holder, floor, done, epoch)
    SELECT %(topic)s, %(channel)s, p.owner,
           coalesce((SELECT h.holder FROM dmq_cursor h
                     WHERE h.topic = %(topic)s AND h.channel <> %(channel)s AND h.owner = p.owner
                     ORDER BY h.channel LIMIT 1),
                    (SELECT h.holder FROM dmq_cursor h WHERE h.owner = p.owner ORDER BY h.topic, h.channel LIMIT 1),
                    p.node_id),
           p.floor, p.done, b.epoch
    FROM plan p CROSS JOIN bumped b
    ORDER BY p.owner  -- the cursors locked in one order, the owners'
    ON CONFLICT (topic, channel, owner) DO UPDATE
    -- what is acknowledged above the incarnation's top (and floor) stays so: those messages
    -- committed after this statement's snapshot (it neither counted nor read them), and an
    -- ack of one may have been made durable since (k: the cursor's row as it is now, locked)
    SET floor = EXCLUDED.floor, epoch = EXCLUDED.epoch,
        done = EXCLUDED.done
               + k.done * int8multirange(int8range((SELECT p.kept FROM plan p WHERE p.owner = k.owner), NULL, '(]'))
               + CASE WHEN k.floor > (SELECT p.kept FROM plan p WHERE p.owner = k.owner)
                      THEN int8multirange(int8range((SELECT p.kept FROM plan p WHERE p.owner = k.owner), k.floor, '(]'))
                      ELSE '{}'::int8multirange END
), cleared AS (
    DELETE FROM dmq_attempts a
    WHERE a.topic = %(topic)s AND a.channel = %(channel)s AND a.message_id > (SELECT floor FROM bounds)
      AND EXISTS (SELECT 1 FROM bumped)
)
SELECT c.copies, b.top, c.first, (SELECT (extract(epoch FROM m.published_at) * 1000)::bigint
                                  FROM dmq_message m WHERE m.id = c.first),
       (SELECT epoch FROM bumped), p.id, (SELECT (extract(epoch FROM m.published_at) * 1000)::bigint
                                          FROM dmq_message m WHERE m.id = p.id)
FROM bounds b CROSS JOIN counted c CROSS JOIN previous p;
