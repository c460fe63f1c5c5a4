"""Loaded only into the dmq node the chaos suite runs under libfaketime (PYTHONPATH set by
``ChaosCluster.restart_node``), before anything else of the node is imported.

With ``DONT_FAKE_MONOTONIC`` (the wall clock jumps, the monotonic clock does not, as with an
NTP step), Debian's libfaketime 0.9.10 makes ``time.sleep`` fail with ``OSError: [Errno 22]
Invalid argument``: Python 3.11 sleeps with ``clock_nanosleep`` on an absolute monotonic
deadline, which that libfaketime mangles. kazoo sleeps with ``time.sleep`` before its set
partitioner allocates, so that node's delay-fragment partitioner always failed and the
clock-jump scenario never counted a delay move by the jumped node. A sleep on ``select``'s
relative timeout (untouched by libfaketime, as the reactor's epoll is) replaces it.
"""

import select
import time


def _sleep(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        select.select([], [], [], left)


time.sleep = _sleep
