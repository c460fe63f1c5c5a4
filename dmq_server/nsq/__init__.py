"""NSQ compatibility: protocol V2, the fast store with nsqd's semantics, the nsqd and
nsqlookupd HTTP APIs. ``docs/nsq.md`` says what is compatible and what differs.

Modules, one noun each. Sans-IO: ``wire`` (codec), ``identify`` (IDENTIFY rules and
reply), ``errors``, ``ids``, ``message``, ``pqueue`` (indexed min-heap), ``metadata``
(``nsqd.dat``), ``responses`` (answers in command order). The fast store: ``channel``,
``topic``, ``nsqd``. Twisted adapters: ``context`` (shared by connections, routes a
topic to the reliable broker or the fast store), ``protocol_v2`` (a connection),
``subscriptions`` (fast and reliable SUB), ``http_v1`` (nsqd's HTTP conventions),
``http`` (nsqd endpoints), ``lookupd`` (nsqlookupd endpoints), ``stats``.
"""

__all__ = [
    "channel",
    "context",
    "errors",
    "http",
    "http_v1",
    "identify",
    "ids",
    "lookupd",
    "message",
    "metadata",
    "nsqd",
    "pqueue",
    "protocol_v2",
    "responses",
    "stats",
    "subscriptions",
    "topic",
    "wire",
]
