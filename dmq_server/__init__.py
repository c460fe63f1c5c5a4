"""dmq server: Twisted TCP/HTTP server persisting reliable messages to PostgreSQL."""

__all__: list[str] = []
