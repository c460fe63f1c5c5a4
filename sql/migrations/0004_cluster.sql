-- dmq schema, version 4: what a cluster of nodes on one PostgreSQL needs.
--
-- Every node delivers only the copies it owns (dmq_delivery.owner = its node id):
-- the backlog loader reads one channel's copies of one owner in id order, and a
-- takeover moves a departed node's copies to a live one (owner = dead -> owner = me),
-- finding the departed owners with a loose index scan. One index serves all three.
CREATE INDEX dmq_delivery_owner_idx ON dmq_delivery (owner, topic, channel, message_id);
