"""The broker layer: one ``Broker`` that every protocol adapter calls, and its cache of
the registry (``topics``). It routes each publish to the reliable or the fast store;
the adapters see it only as ``interfaces.BrokerPort``, the one seam between them and the
stores."""

from dmq_server.broker.broker import REPLAY_PRODUCER, Broker, Fence
from dmq_server.broker.topics import FAST, RELIABLE, TopicCache

__all__ = ["Broker", "Fence", "TopicCache", "RELIABLE", "FAST", "REPLAY_PRODUCER"]
