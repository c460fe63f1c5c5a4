"""The IO-free core: wire codecs of the NSQ protocol, message ids, settings, rate limits,
fragment arithmetic. Standard library only (an import-linter contract checks it), so
every rule here is tested without a socket, a reactor or a database.
"""
