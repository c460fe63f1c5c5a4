"""dmq client library. ``dmq_client.blocking.BlockingClient`` is the small synchronous client;
``dmq_client.wire`` is the sans-IO protocol codec shared with the server."""

__all__: list[str] = []
