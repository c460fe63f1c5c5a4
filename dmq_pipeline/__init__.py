"""dmq data pipeline (PySpark): archive, delivery report, bulk dead-letter replay. Arrives with its own issue."""

__all__: list[str] = []
