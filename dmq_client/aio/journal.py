"""The producer journal of the asyncio client: ``dmq_client.journal``'s files, its disk IO off
the event loop.

The journal is ``MqClient``'s (``JournalSendQueue``: the same directory, records, recovery
and guarantees, so either client replays what the other left). What differs is who waits
for the disk: ``MqClient``'s caller blocks in ``send()`` while its record is written and
fdatasync'ed, which on the event loop would stall every other task. Here a send hands its
record over (``put``) and the loop goes on; one worker task collects the records handed
over meanwhile and writes them in a worker thread (``asyncio.to_thread``) with a single
fdatasync for the whole batch (``JournalSendQueue.keep``): the group commit that
``MqClient``'s concurrent senders get from their threads, here among the concurrent sends
of the loop, with one thread hop per batch instead of one per send. The same worker
forgets the finished records (``task_done``, which reads them off the disk queue) in
that thread, and the journal is opened (its recovery reads every record) and shut down
there too.

A send is *accepted* once its record is handed over: from then on it is not taken back
(see ``dmq_client.aio.sends`` for what that means for a cancelled send).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from ..config import MqConfig
from ..journal import JournalSendQueue
from ..pending import PendingSend
from ..send_queue import Put

__all__ = ["AioJournal"]

log = logging.getLogger(__name__)

#: what ``put`` calls, on the loop, once the record is written: the answer, and why it failed
Written = Callable[[Put, str], None]


class AioJournal:
    """An open ``JournalSendQueue`` driven from the event loop. ``open`` it (a coroutine:
    the recovery reads the files), take ``recovered``, ``put`` records, tell it the
    ``finished`` ones, ``close`` it."""

    def __init__(self, queue: JournalSendQueue):
        self.queue = queue
        #: the unfinished records of an earlier client, in their original order: to be sent
        #: again under their own producer and session ids (their callback logs the result
        #: and calls ``recovered_callback``)
        self.recovered: list[PendingSend] = queue.drain()
        self._puts: list[tuple[PendingSend, Written]] = []
        self._finished: list[PendingSend] = []
        self._worker: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, config: MqConfig, producer_id: str) -> "AioJournal":
        """Open ``config.journal_path`` for a client whose new sends go under ``producer_id``
        (``JournalError`` if another client has it open)."""
        queue = await asyncio.to_thread(JournalSendQueue.from_config, config.replace(producer_id=producer_id))
        return cls(queue)

    def put(self, record: PendingSend, written: Written) -> None:
        """Journal ``record``; ``written(answer, why)`` is called on the loop once it is on
        disk as ``journal_sync_every`` asks (``Put.ACCEPTED``), or refused."""
        self._puts.append((record, written))
        self._kick()

    def finished(self, record: PendingSend) -> None:
        """``record.result`` was delivered: the journal forgets it if that result is final
        (or the send was given up), and keeps it for the next client otherwise."""
        self._finished.append(record)
        self._kick()

    async def idle(self) -> None:
        """Wait until every record handed over so far is written and every finish applied."""
        while self._worker is not None and not self._worker.done():
            await asyncio.shield(self._worker)

    async def close(self) -> None:
        """Apply what is pending, then sync and close the files (in a worker thread)."""
        await self.idle()
        await asyncio.to_thread(self.queue.shutdown)

    def _kick(self) -> None:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._work(), name="dmq-journal")

    async def _work(self) -> None:
        while self._puts or self._finished:
            puts, self._puts = self._puts, []
            finished, self._finished = self._finished, []
            answers = await asyncio.to_thread(self._io, [record for record, _ in puts], finished)
            why = self.queue.last_error
            for (_, written), answer in zip(puts, answers):
                try:
                    written(answer, "" if answer is Put.ACCEPTED else why)
                except Exception:  # a bug in the send's bookkeeping must not stop the journal
                    log.exception("journal %s: handling a written record failed", self.queue.path)

    def _io(self, records: list[PendingSend], finished: list[PendingSend]) -> list[Put]:
        """The worker thread's part: forget the finished records, write the new ones."""
        for record in finished:
            try:
                self.queue.task_done(record)
            except Exception:
                log.exception("journal %s: forgetting a finished record failed", self.queue.path)
        if not records:
            return []
        try:
            return self.queue.keep(records)
        except Exception as exc:
            log.exception("journal %s: writing records failed", self.queue.path)
            self.queue.last_error = f"E_JOURNAL the producer journal could not store the message: {exc}"
            return [Put.FAILED] * len(records)
