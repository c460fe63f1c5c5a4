"""Security: TLS on every listener and who a client is, in one place the adapters call.

``tls`` builds the server's TLS context (re-read on SIGHUP) and reads what a connection's
peer proved; ``authorizer`` asks nsqd-style auth servers or reads ``--auth-file``;
``session`` keeps a connection's (or an HTTP credential's) answer and decides each
publish, subscribe and admin request; ``exposure`` names the listeners left open to a
network. The policy itself (answers, regexes, permissions) is IO-free, in
``dmq_server.core.auth``.
"""

__all__: list[str] = []
