"""The import contracts in pyproject.toml (``[tool.importlinter]``) hold.

They are what keeps the layers apart as the code grows: the client library never
pulls in the server, the wire codecs stay sans-IO (standard library only), nothing
below the pipeline imports it. A wrong import fails here, naming the import chain.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_import_contracts_are_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


# -- the seam between adapters and stores (issue 43) ----------------------------------
# The import contract above keeps the stores' modules out of the adapters; it cannot
# see an adapter that reaches a store through the broker's attributes, or that asks
# the broker which store a topic is on and branches. This walks every adapter module's
# syntax tree for both.
ADAPTERS = ("protocols", "http", "admin", "security")
STORE_MODULES = ("dmq_server.reliable", "dmq_server.fast")
# what of the broker is a store, a store's label or a PostgreSQL cluster
PAST_THE_BROKER = {"fast", "reliable", "stores", "placement", "route", "FAST", "RELIABLE"}
# the stores' classes, and the broker's cache that says which store holds a topic: an
# adapter that names one, however it got it (a re-export, an annotation), knows the stores
STORE_NAMES = {"FastStore", "ReliableStore", "TopicCache"}
# asking which store serves a topic (broker.topics.TopicCache.store_of), on any object
WHICH_STORE = {"store_of"}
# Uses known and not yet moved behind the broker. Nothing may be added here; an entry
# whose use is gone fails too.
NOT_YET: set[tuple[str, str]] = set()


def _ends_with_broker(node: ast.expr) -> bool:
    """``broker``, ``self.broker``, ``self.ops.broker``, ``ctx.broker``, ``self._broker``..."""
    if isinstance(node, ast.Name):
        return node.id.lower().endswith("broker")
    return isinstance(node, ast.Attribute) and node.attr.lower().endswith("broker")


def seam_breaches(source: str) -> list[str]:
    """Each way ``source`` (an adapter module) names a store or reaches past the broker."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.startswith(STORE_MODULES)]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.startswith(STORE_MODULES):
                found.append(f"from {module} import ...")
            elif module.startswith("dmq_server.broker"):
                found += [f"from {module} import {a.name}" for a in node.names if a.name in PAST_THE_BROKER]
            found += [f"from {module} import {a.name}" for a in node.names if a.name in STORE_NAMES]
        elif isinstance(node, ast.Name) and node.id in STORE_NAMES:
            found.append(node.id)
        elif isinstance(node, ast.Attribute) and (node.attr in STORE_NAMES or node.attr in WHICH_STORE):
            found.append(f"{ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr in PAST_THE_BROKER and _ends_with_broker(node.value):
            found.append(f"{ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and (node.attr in ("fast_store", "reliable_store") or (
                node.attr == "store" and isinstance(node.value, ast.Name) and node.value.id in ("self", "ctx"))):
            found.append(f"{ast.unparse(node)}")  # a store handed to the adapter beside the broker
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and _ends_with_broker(node.args[0])
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in PAST_THE_BROKER):
            found.append(f"{node.func.id}({ast.unparse(node.args[0])}, {node.args[1].value!r})")
    return found


def test_no_adapter_names_a_store_or_reaches_past_the_broker():
    """The protocol, HTTP and admin adapters hand the broker requests and get answers
    (``dmq_server/broker/interfaces.py``): none imports a store, the broker's store labels,
    or reads the broker's stores, its placement over PostgreSQL clusters or its routing."""
    server = REPO / "dmq_server"
    breaches = set()
    for package in ADAPTERS:
        for path in sorted((server / package).rglob("*.py")):
            name = path.relative_to(server).as_posix()
            breaches |= {(name, what) for what in seam_breaches(path.read_text())}
    assert breaches - NOT_YET == set()
    assert NOT_YET - breaches == set(), "gone: remove it from NOT_YET"


def test_the_seam_check_sees_each_kind_of_breach():
    """The walk is not blind: each way past the broker is found, and a plain broker
    call is not."""
    source = (
        "import dmq_server.fast.fast_store\n"
        "from dmq_server.reliable.channel import ReliableChannel\n"
        "from dmq_server.broker import FAST, Broker\n"
        "self.broker.fast.get_topic('t')\n"
        "ctx.broker.stores['main']\n"
        "broker.route('t', True, print)\n"
        "getattr(self.ops.broker, 'placement', None)\n"
        "self.broker.publish(request, done)\n"
        "self.store.get_topic('t')\n"
        "print(row.store)\n"
        "self._broker.reliable.writer\n"
        "from dmq_server.broker import TopicCache\n"
        "from dmq_server import ReliableStore as S\n"
        "def f(store: 'x', other: FastStore) -> None: ...\n"
        "if self.cache.store_of(topic) == 'fast': pass\n"
        "broker_stats = self.broker.stats()\n"
    )
    assert sorted(seam_breaches(source)) == sorted([
        "import dmq_server.fast.fast_store",
        "from dmq_server.reliable.channel import ...",
        "from dmq_server.broker import FAST",
        "self.broker.fast",
        "ctx.broker.stores",
        "broker.route",
        "getattr(self.ops.broker, 'placement')",
        "self.store",
        "self._broker.reliable",
        "from dmq_server.broker import TopicCache",
        "from dmq_server import ReliableStore",
        "FastStore",
        "self.cache.store_of",
    ])


# -- the broker's stores stay the broker's (issue 43 item 5) ----------------------------
# Outside broker/ and the stores, no module reads the broker's stores: /metrics, /stats,
# sampling and the consoles read ``Broker.snapshot()``; the assembly hands the cluster
# node and each delay scheduler their stores through ``Broker.cluster_stores()``.
STORE_ATTRIBUTES = {"reliable", "fast", "stores", "placement"}


def store_reads(source: str) -> set[str]:
    """Each read of a store attribute of a broker (``broker.reliable``, ``self.broker.stores``,
    ``getattr(broker, 'fast')``) in ``source``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in STORE_ATTRIBUTES and _ends_with_broker(node.value):
            found.add(ast.unparse(node))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and _ends_with_broker(node.args[0])
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in STORE_ATTRIBUTES):
            found.add(f"{node.func.id}({ast.unparse(node.args[0])}, {node.args[1].value!r})")
    return found


def test_no_module_outside_the_broker_and_the_stores_reads_the_brokers_stores():
    server = REPO / "dmq_server"
    reads = set()
    for path in sorted(server.rglob("*.py")):
        name = path.relative_to(server).as_posix()
        if name.split("/")[0] not in ("broker", "reliable", "fast"):
            reads |= {(name, what) for what in store_reads(path.read_text())}
    assert reads == set()


def test_the_store_read_check_sees_each_kind_of_read():
    source = ("x = self.broker.reliable.writer.commit_seconds\ny = getattr(broker, 'fast', None)\n"
              "z = ctx.broker.stores\nbroker.stats()\n")
    assert store_reads(source) == {"self.broker.reliable", "getattr(broker, 'fast')", "ctx.broker.stores"}
