-- The report's figures computed independently in SQL, over the same tables, for
-- tests/pipeline/test_report.py. Range parameters: since, until.

-- name: expected_throughput
-- Acknowledged deliveries per topic, channel and UTC minute.
SELECT topic, channel, date_trunc('minute', acked_at) AS minute, count(*) AS acked
FROM dmq_delivery_log
WHERE acked_at >= %(since)s AND acked_at < %(until)s
GROUP BY 1, 2, 3 ORDER BY 1, 2, 3;

-- name: expected_latency
-- Delivered count and latency percentiles (ms) per topic and channel.
SELECT topic, channel, count(*) AS delivered,
       percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP
           (ORDER BY (extract(epoch FROM acked_at - published_at) * 1000)::float8) AS pct,
       max((extract(epoch FROM acked_at - published_at) * 1000)::float8) AS max_ms
FROM dmq_delivery_log
WHERE acked_at >= %(since)s AND acked_at < %(until)s
GROUP BY 1, 2 ORDER BY 1, 2;

-- name: expected_attempts
-- Deliveries per topic, channel and attempts.
SELECT topic, channel, attempts, count(*) AS deliveries
FROM dmq_delivery_log
WHERE acked_at >= %(since)s AND acked_at < %(until)s
GROUP BY 1, 2, 3 ORDER BY 1, 2, 3;

-- name: expected_backlog_series
-- Copies published by the end of each minute with a change and not acknowledged by then.
WITH copies AS (
    SELECT topic, channel, date_trunc('minute', published_at) AS pub,
           CASE WHEN acked_at < %(until)s THEN date_trunc('minute', acked_at) END AS ack
    FROM dmq_delivery_log
    WHERE acked_at >= %(since)s AND published_at < %(until)s
    UNION ALL
    SELECT d.topic, d.channel, date_trunc('minute', m.published_at), NULL
    FROM dmq_pending d JOIN dmq_message m ON m.id = d.message_id
    WHERE m.published_at < %(until)s
), minutes AS (
    SELECT topic, channel, pub AS minute FROM copies
    UNION SELECT topic, channel, ack FROM copies WHERE ack IS NOT NULL
    UNION SELECT DISTINCT topic, channel, date_trunc('minute', %(since)s::timestamptz) FROM copies
)
SELECT n.topic, n.channel, n.minute,
       (SELECT count(*) FROM copies c
        WHERE c.topic = n.topic AND c.channel = n.channel AND c.pub <= n.minute
          AND (c.ack IS NULL OR c.ack > n.minute)) AS backlog
FROM minutes n
WHERE n.minute >= date_trunc('minute', %(since)s::timestamptz)
ORDER BY 1, 2, 3;

-- name: expected_pending
-- Unacknowledged copies now, per topic and channel.
SELECT topic, channel, count(*) FROM dmq_pending GROUP BY 1, 2 ORDER BY 1, 2;

-- name: expected_dead_letters
-- Dead letters per topic, channel and reason, and how many were replayed.
SELECT topic, coalesce(channel, '') AS channel, reason, count(*) AS dead_letters,
       count(replayed_at) AS replayed
FROM dmq_dead_letter
WHERE dead_at >= %(since)s AND dead_at < %(until)s
GROUP BY 1, 2, 3 ORDER BY 1, 2, 3;
