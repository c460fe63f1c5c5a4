"""What operators see of an outbox, on real PostgreSQL and a running dmq-server with
--outbox: /metrics, /stats, the admin API and `dmq outbox list` agree on the pending rows
and the oldest one's age while another session holds the relay lock (the relay stands
by), on the rows relayed and dead-lettered once it relays, on which node relays, and
while the relay is stuck on a row lock (the figures are read on a connection of their
own), and the console's Outboxes page in a real browser. The DSN's password is never shown."""

from __future__ import annotations

import json

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .support import http_get, run_cli, scrape_metrics, wait_for
from .test_console_browser import Console, browser  # noqa: F401 (a fixture)
from .test_outbox_relay import _hold_rows, _relay_waits_to_delete, app_dsn, send_transaction  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration

WAIT = 30.0
RELAY_LOCK = "SELECT pg_advisory_lock(7361045, hashtext('dmq_outbox'))"


def with_password(dsn: str) -> str:
    """The DSN with the test server's password written in it (it names a passfile)."""
    parts = conninfo_to_dict(dsn)
    with open(str(parts.pop("passfile"))) as passfile:
        password = passfile.read().split(":")[-1].strip()
    return make_conninfo(**{**parts, "password": password})


def password_of(dsn: str) -> str:
    return str(conninfo_to_dict(dsn)["password"])


def metric(server, name: str, outbox: str = "shop") -> float | None:
    return scrape_metrics(server.http).get((name, (("outbox", outbox),)))


def stats_outboxes(server, password: str = "") -> list[dict]:
    status, text = http_get(server.http + "/stats")
    assert status == 200, text
    assert not password or password not in text
    return json.loads(text)["outboxes"]


def cli_list(server, pg_dsn: str, *extra: str, password: str = ""):
    done = run_cli(pg_dsn, "--http-address", f"127.0.0.1:{server.http_port}", "outbox", "list", *extra)
    assert done.returncode == 0, done.stderr
    assert not password or password not in done.stdout + done.stderr
    return done.stdout


def shop_line(listing: str) -> str:
    (line,) = [row for row in listing.splitlines() if row.startswith("shop ")]
    return line


def holder(app_dsn: str) -> psycopg.Connection:
    """Another session holding the relay lock, as a relay on another node would."""
    conn = psycopg.connect(make_conninfo(app_dsn, application_name="other-relay"), autocommit=True)
    conn.execute(RELAY_LOCK)
    return conn


def test_pending_while_another_holds_the_lock_then_relayed_and_dead_lettered(make_server, topic, pg_dsn, app_dsn):
    """M rows pending while another session holds the lock: pending M, the oldest's age
    growing, this node not relaying and the holder named; once the lock is free this node
    relays them: relayed M + N, one dead letter (unknown topic), nothing pending."""
    other = holder(app_dsn)
    sent = [f"held-{k}".encode() for k in range(7)]
    send_transaction(app_dsn, sent)
    dsn = with_password(app_dsn)
    secret = password_of(dsn)
    server = make_server(outbox=f"shop={dsn}", node_id="node-a")

    wait_for(lambda: metric(server, "dmq_outbox_pending_rows") == 7, timeout=WAIT)
    assert metric(server, "dmq_outbox_relaying") == 0
    assert metric(server, "dmq_outbox_relayed_total") == 0
    first = metric(server, "dmq_outbox_oldest_pending_seconds")
    assert first is not None and first > 0
    # the next reading (a second later) is older: the age is the oldest row's, not a constant
    wait_for(lambda: metric(server, "dmq_outbox_oldest_pending_seconds") > first + 0.5, timeout=WAIT)
    (shown,) = stats_outboxes(server, secret)
    assert shown["name"] == "shop" and shown["schema"] == "dmq_outbox" and shown["pending"] == 7
    assert shown["relaying"] is False and shown["relaying_node"] == "other-relay"
    assert shown["node_id"] == "node-a" and "/" in shown["database"]
    line = shop_line(cli_list(server, pg_dsn, password=secret))
    assert "other-relay" in line and "(this node)" not in line and line.split()[-4] == "7"

    # 10000 more (the count's bound): shown as at least that many
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO dmq_outbox.outbox (topic, body) SELECT 'orders', 'bulk'::bytea "
                     "FROM generate_series(1, 10000)")
    wait_for(lambda: metric(server, "dmq_outbox_pending_rows") == 10000, timeout=WAIT)
    assert stats_outboxes(server)[0]["pending_at_least"] is True
    assert "10000+" in cli_list(server, pg_dsn)

    other.close()  # the lock is free: this node takes it and relays
    send_transaction(app_dsn, [b"late-1", b"late-2"])
    send_transaction(app_dsn, [b"lost"], topic="nosuch")
    wait_for(lambda: metric(server, "dmq_outbox_relayed_total") == 10009, timeout=90)
    wait_for(lambda: metric(server, "dmq_outbox_dead_lettered_total") == 1, timeout=WAIT)
    assert metric(server, "dmq_outbox_relaying") == 1
    wait_for(lambda: metric(server, "dmq_outbox_pending_rows") == 0, timeout=WAIT)
    assert metric(server, "dmq_outbox_oldest_pending_seconds") == 0
    assert 0 <= metric(server, "dmq_outbox_last_cycle_seconds") < 5
    (shown,) = stats_outboxes(server)
    assert shown["relaying"] is True and shown["relaying_node"] == "node-a"
    assert (shown["relayed"], shown["dead_lettered"], shown["pending"]) == (10009, 1, 0)
    status, text = http_get(server.http + "/admin/outboxes")
    assert status == 200 and secret not in text
    (api,) = json.loads(text)["outboxes"]
    assert {k: api[k] for k in ("name", "relaying_node", "relayed", "dead_lettered", "pending")} == {
        "name": "shop", "relaying_node": "node-a", "relayed": 10009, "dead_lettered": 1, "pending": 0}
    line = shop_line(cli_list(server, pg_dsn))
    assert "node-a (this node)" in line and line.split()[-2:] == ["10009", "1"]
    assert json.loads(cli_list(server, pg_dsn, "--json"))[0]["relayed"] == 10009


def test_a_relay_stuck_on_a_row_lock_still_shows_what_waits(make_server, topic, pg_dsn, app_dsn):
    """The relay stored M rows and its delete waits for their row locks: the figures, read
    on a connection of their own, still show M pending (still in the outbox), M relayed
    (stored in dmq: the relay counts a row when its store is answered, and deletes it with
    its next read), this node relaying and the time since its last cycle growing; once the
    locks go, the rows leave the outbox and are not counted twice."""
    send_transaction(app_dsn, [f"stuck-{k}".encode() for k in range(4)])
    blocker = _hold_rows(app_dsn)
    try:
        server = make_server(outbox=f"shop={app_dsn}", node_id="node-b")
        wait_for(lambda: _relay_waits_to_delete(app_dsn), timeout=WAIT)
        wait_for(lambda: metric(server, "dmq_outbox_pending_rows") == 4, timeout=WAIT)
        wait_for(lambda: metric(server, "dmq_outbox_last_cycle_seconds") > 2, timeout=WAIT)
        assert metric(server, "dmq_outbox_relaying") == 1
        assert metric(server, "dmq_outbox_relayed_total") == 4
        assert stats_outboxes(server)[0]["relaying_node"] == "node-b"
    finally:
        blocker.rollback()
        blocker.close()
    wait_for(lambda: metric(server, "dmq_outbox_pending_rows") == 0, timeout=WAIT)
    assert metric(server, "dmq_outbox_relayed_total") == 4


def test_the_console_lists_the_outboxes(make_server, topic, app_dsn, browser):  # noqa: F811 (a fixture)
    """The console's Outboxes page, in a real browser: the pending rows and the holder while
    another session holds the lock, then (refreshing itself) this node relaying them."""
    other = holder(app_dsn)
    send_transaction(app_dsn, [f"page-{k}".encode() for k in range(7)])
    dsn = with_password(app_dsn)
    server = make_server(outbox=f"shop={dsn}", node_id="node-c")
    wait_for(lambda: metric(server, "dmq_outbox_pending_rows") == 7, timeout=WAIT)
    console = Console(browser, server)
    console.open("#/outboxes")
    row = "#outboxes tr[data-outbox='shop']"
    assert console.text(f"{row} td.pending") == "7"
    assert console.text(f"{row} td.relaying") == "other-relay"
    assert console.text(f"{row} td.relayed") == "0"
    assert console.text(f"{row} td.oldest").endswith(" s")
    assert password_of(dsn) not in browser.page_source
    console.shot("outboxes-held")
    other.close()
    wait_for(lambda: console.text(f"{row} td.relayed") == "7", timeout=WAIT)
    wait_for(lambda: console.text(f"{row} td.pending") == "0", timeout=WAIT)
    assert console.text(f"{row} td.relaying") == "node-c (this node)"
    assert console.text(f"{row} td.oldest") == "–"
    console.shot("outboxes")
