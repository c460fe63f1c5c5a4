"""The command lines' answer to a reader that went away (``dmq dlq list --json | head``).

Here, in the standard-library-only client package, because all three programs
use it (``dmq``, ``dmq-server``, ``dmq-pipeline``) and the pipeline imports no server.

Python ignores SIGPIPE, so a write to a closed pipe raises BrokenPipeError, which
ended in a traceback (and a second one when the interpreter flushed stdout at exit).
Restoring SIGPIPE's default would kill the process quietly, but also on a write to
a closed *socket* (PostgreSQL, ZooKeeper, a server's HTTP port), so the entry points
catch the error instead: stdout is pointed at /dev/null so nothing more is written,
and the command exits with 141, the status of a process killed by SIGPIPE, as a
shell pipeline expects of ``yes | head``.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator

__all__ = ["BROKEN_PIPE_EXIT", "quiet_broken_pipe"]

#: 128 + SIGPIPE, what the shell reports for a command the signal ended
BROKEN_PIPE_EXIT = 141


class Outcome:
    """What ``quiet_broken_pipe`` saw: ``code`` is the exit status to return when the
    block ended because the pipe closed."""

    code = BROKEN_PIPE_EXIT
    closed = False


@contextmanager
def quiet_broken_pipe() -> Iterator[Outcome]:
    """Run a command's body; a BrokenPipeError ends it quietly (see the module doc)."""
    outcome = Outcome()
    try:
        yield outcome
    except BrokenPipeError:
        outcome.closed = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # stdout has no descriptor (tests capture it): nothing to flush
            pass
