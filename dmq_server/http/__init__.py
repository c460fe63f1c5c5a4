"""The HTTP port: nsqd's and nsqlookupd's APIs, dmq's admin API, ``/ping``, ``/info`` and
``/stats``, on one bounded twisted.web site.
"""
