"""The fast store, with nsqd's semantics: topics and channels in memory, overflowing to
go-diskqueue files, ``nsqd.dat`` metadata.
"""
