-- dmq schema, version 5: an operator's pause of a reliable channel (nsqd's channel
-- pause), kept in PostgreSQL so that it survives a restart and every node of a
-- cluster sees it. A row means paused; removing the channel removes its pause.
CREATE TABLE dmq_channel_pause (
    topic      text NOT NULL,
    channel    text NOT NULL,
    paused_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, channel),
    FOREIGN KEY (topic, channel) REFERENCES dmq_channel (topic, name) ON DELETE CASCADE
);
