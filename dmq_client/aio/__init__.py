"""The asyncio dmq client: ``async with Client(...)``, ``await client.send(message)``,
``async for message in client.subscribe(topic, channel, credit=N)``, ``await message.ack()``
and ``await message.requeue(delay=seconds)``.

It speaks the protocol through the same sans-IO codec as everything else
(``dmq_client.wire``) over asyncio streams, with no threads (but for the blocking calls of ZooKeeper discovery
and of the producer journal, which run in worker threads), and gives ``MqClient``'s
results (``SendResult``, ``Status``) and guarantees; ``docs/client.md`` ("asyncio") is the
guide. Modules: ``client`` (the ``Client``; ZooKeeper discovery), ``link`` (one server
connection), ``sends`` (unanswered sends, resends, failover, backpressure, cancellation),
``journal`` (the producer journal's disk IO off the loop), ``confirms`` (confirmation when
consumed: ``send(..., confirm="consumed")``), ``subscribe`` (subscriptions, the received
message, acks batched per loop turn). The inbox's asyncio form is
``dmq_client.inbox.atransaction``.
"""

from .client import Client
from .confirms import Confirmation
from .subscribe import AioMessage, RequeueError, Subscription

__all__ = ["AioMessage", "Client", "Confirmation", "RequeueError", "Subscription"]
