"""The znode layout of dmq's ZooKeeper registry, in one place.

::

    /dmq
      /topic                      persistent
        /<topic>                  persistent; data: the topic's settings (JSON)
          /<channel>              persistent; one child per channel (subscription)
      /node                       persistent
        /<node-id>                ephemeral; data: addresses, version, start time,
                                  last heartbeat, fast topics (JSON)
      /takeover
        /<node-id>                kazoo Lock: held while a node's unacknowledged
                                  copies change owner (takeover or re-registration)
      /delay/fragments            delay fragments shared among live nodes (kazoo
                                  SetPartitioner; dmq_server/cluster/fragments.py)
      /cluster
        /<name>                   persistent; a PostgreSQL cluster topics may be placed
                                  on (--pg-cluster), made by the nodes that connect to it
      /outbox
        /<name>                   persistent; an outbox attached at run time (`dmq outbox
                                  attach`); data: its schema and database (JSON, never the
                                  DSN: dmq's dmq_outbox_attached holds that)
      /outbox_relay
        /<name>                   PlacementLock: the node that relays the outbox (with --zk,
                                  only its holder tries the application database's lock)
      /orderer
        /<topic>                  PlacementLock: the node that delivers the ordered
                                  topic's copies, every node's (its orderer; every node
                                  contends once a second, dmq_server/cluster/orderers.py;
                                  the cursor holder stays the fence); data of this znode
                                  itself: the note a cleanly stopping orderer leaves

Everything sits under an optional chroot given with the address
(``zk1:2181,zk2:2181/prod``). Nothing here talks to ZooKeeper; the server and
the client library both read the layout from this module.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

__all__ = [
    "ROOT",
    "TOPICS",
    "NODES",
    "TAKEOVER",
    "DELAY_FRAGMENTS",
    "CLUSTERS",
    "OUTBOXES",
    "OUTBOX_RELAYS",
    "ORDERERS",
    "outbox",
    "outbox_relay",
    "orderer",
    "cluster",
    "topic",
    "channel",
    "node",
    "node_id_of",
    "takeover_lock",
    "check_znode_name",
    "parse_address",
]

ROOT = "/dmq"
TOPICS = ROOT + "/topic"
NODES = ROOT + "/node"
TAKEOVER = ROOT + "/takeover"
DELAY_FRAGMENTS = ROOT + "/delay/fragments"
CLUSTERS = ROOT + "/cluster"
OUTBOXES = ROOT + "/outbox"
OUTBOX_RELAYS = ROOT + "/outbox_relay"
ORDERERS = ROOT + "/orderer"

# Node ids are free text (default "host:port"); a "/" would split the path, so ids are
# percent-encoded in znode names. Topic and channel names are already safe.
_NODE_SAFE = ":@.,_-+=~"


def check_znode_name(kind: str, name: str) -> None:
    """ZooKeeper refuses "." and ".." as node names; dmq's name rule allows them."""
    if name in (".", ".."):
        raise ValueError(f"{kind} name {name!r} cannot be stored in ZooKeeper")


def topic(name: str) -> str:
    return f"{TOPICS}/{name}"


def cluster(name: str) -> str:
    return f"{CLUSTERS}/{name}"


def outbox(name: str) -> str:
    return f"{OUTBOXES}/{name}"


def outbox_relay(name: str) -> str:
    return f"{OUTBOX_RELAYS}/{name}"


def orderer(topic_name: str) -> str:
    """The lock whose holder delivers the ordered topic ``topic_name`` (ZooKeeper refuses
    "." and "..": ``check_znode_name`` says so)."""
    check_znode_name("topic", topic_name)
    return f"{ORDERERS}/{topic_name}"


def channel(topic_name: str, name: str) -> str:
    return f"{TOPICS}/{topic_name}/{name}"


def node(node_id: str) -> str:
    return f"{NODES}/{quote(node_id, safe=_NODE_SAFE)}"


def node_id_of(znode_name: str) -> str:
    """The node id behind a child name of ``/dmq/node``."""
    return unquote(znode_name)


def takeover_lock(node_id: str) -> str:
    return f"{TAKEOVER}/{quote(node_id, safe=_NODE_SAFE)}"


def parse_address(text: str) -> tuple[str, str]:
    """``"h1:2181,h2:2181/chroot"`` into ``("h1:2181,h2:2181", "/chroot")``.

    The chroot is optional ("" when absent). Each host needs a port; IPv6 hosts are
    written in brackets (``[::1]:2181``).
    """
    text = text.strip()
    if not text:
        raise ValueError("empty ZooKeeper address")
    slash = text.find("/")
    hosts, chroot = (text, "") if slash < 0 else (text[:slash], text[slash:].rstrip("/"))
    for host in hosts.split(","):
        name, sep, port = host.strip().rpartition(":")
        if not sep or not name or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(
                f"invalid ZooKeeper address {text!r}: expected HOST:PORT[,HOST:PORT...][/chroot]"
            )
    if chroot and any(part in ("", ".", "..") for part in chroot[1:].split("/")):
        raise ValueError(f"invalid ZooKeeper chroot {chroot!r}")
    return ",".join(h.strip() for h in hosts.split(",")), chroot
