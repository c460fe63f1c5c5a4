"""The reliable store: messages kept in PostgreSQL before the producer hears "stored",
a channel's memory window and redelivery, the group-commit writer and the ack batcher,
delayed messages and dead letters.
"""
