-- dmq schema, version 15: the record of what an outbox relay stored is written by the
-- storing statement itself, not by row triggers.
--
-- Version 13 recorded each outbox row's (producer, session_id) in dmq_outbox_relayed with
-- a plpgsql BEFORE INSERT trigger on dmq_message and dmq_delay. A plpgsql call and its
-- own INSERT per row cost dmq's PostgreSQL about three times a direct publish's time a
-- message (docs/benchmarks.md, "The outbox relay"), and the relay's drain was bound by it.
-- The group commit now stores a batch that holds outbox rows with insert_outbox_messages
-- or insert_outbox_delayed (sql/queries.sql): one INSERT of the batch's pairs into
-- dmq_outbox_relayed in the same statement and commit as the messages, and only the rows
-- recorded now are stored. What holds is unchanged: a pair recorded before is never
-- stored again, also after its message was swept. Batches without outbox rows run
-- insert_messages as before and pay nothing (not even the triggers' WHEN conditions).
DROP TRIGGER dmq_message_outbox_once ON dmq_message;
DROP TRIGGER dmq_delay_outbox_once ON dmq_delay;
DROP FUNCTION dmq_outbox_relayed_once();
