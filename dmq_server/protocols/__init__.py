"""The TCP adapters: the shared port that sniffs the protocol, the dmq protocol, NSQ V2,
and the flow control both use. Thin: codecs come from the core, decisions from the broker.
"""
