"""An ordered topic (issue 45 §2) as a setting, end to end on a real PostgreSQL: `dmq topic
create --ordered`, `dmq topic update --ordered / --no-ordered`, what `topic list/show`
print, and a running server's view of it (the HTTP admin API, the line console, the web
console in a real browser), which comes from the registry refresh that also hands the
reliable store its topics."""

from __future__ import annotations

import json

from .support import db_rows, run_cli, wait_for
from .test_admin_surfaces import Console, admin_server, http
from .test_console_browser import Console as Page
from .test_console_browser import browser  # noqa: F401  (the fixture: a real chromium)


def _cli(dsn: str, *args: str) -> str:
    out = run_cli(dsn, *args)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _shown(dsn: str, name: str) -> dict:
    return json.loads(_cli(dsn, "topic", "show", name))


def test_the_cli_creates_updates_and_shows_an_ordered_topic(pg_dsn):
    """--ordered at create time is stored; update turns it off and on again (the other
    settings and the channels stay); list and show print it; a topic created without it
    is not ordered."""
    created = _cli(pg_dsn, "topic", "create", "orders", "--ordered", "--max-attempts", "3")
    assert created == "created ordered topic orders"
    assert _cli(pg_dsn, "topic", "create", "plain") == "created topic plain"
    _cli(pg_dsn, "channel", "add", "orders", "billing")
    assert db_rows(pg_dsn, "SELECT name, ordered FROM dmq_topic ORDER BY name") == [("orders", True), ("plain", False)]
    assert _shown(pg_dsn, "orders")["ordered"] is True and _shown(pg_dsn, "plain")["ordered"] is False
    listed = {t["name"]: t["ordered"] for t in json.loads(_cli(pg_dsn, "topic", "list", "--json"))}
    assert listed == {"orders": True, "plain": False}
    table = _cli(pg_dsn, "topic", "list").splitlines()
    assert table[0].split("\t")[:2] == ["orders", "reliable ordered"]
    assert table[1].split("\t")[:2] == ["plain", "reliable"]

    assert _cli(pg_dsn, "topic", "update", "orders", "--no-ordered") == "updated topic orders: ordered on -> off"
    shown = _shown(pg_dsn, "orders")
    assert (shown["ordered"], shown["max_attempts"], shown["channels"]) == (False, 3, ["billing"])
    assert _cli(pg_dsn, "topic", "update", "orders", "--no-ordered") == "updated topic orders: no change"
    out = _cli(pg_dsn, "topic", "update", "orders", "--ordered", "--rate-limit", "9")
    assert out == "updated topic orders: rate_limit none -> 9, ordered off -> on"
    assert db_rows(pg_dsn, "SELECT ordered, rate_limit FROM dmq_topic WHERE name = 'orders'") == [(True, 9)]
    assert _cli(pg_dsn, "topic", "update", "plain", "--ordered") == "updated topic plain: ordered off -> on"


def test_a_fast_topic_cannot_be_ordered(pg_dsn):
    """A fast topic delivers as nsqd does: --ordered is refused at create time (a refused
    operation, 1) and by update (bad usage, 2), with the reason; nothing is stored."""
    out = run_cli(pg_dsn, "topic", "create", "clicks", "--store", "fast", "--ordered")
    assert out.returncode == 1 and "only a reliable topic can be ordered" in out.stderr, out
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_topic") == [(0,)]
    _cli(pg_dsn, "topic", "create", "clicks", "--store", "fast")
    out = run_cli(pg_dsn, "topic", "update", "clicks", "--ordered")
    assert out.returncode == 2 and "only a reliable topic can be ordered" in out.stderr, out
    assert db_rows(pg_dsn, "SELECT ordered FROM dmq_topic") == [(False,)]
    assert _cli(pg_dsn, "topic", "update", "clicks", "--no-ordered") == "updated topic clicks: no change"


def test_a_running_server_shows_the_setting_and_follows_an_update(make_server, pg_dsn):
    """The HTTP admin API and the line console list ``ordered`` with the other settings;
    after `dmq topic update --no-ordered` the server's next registry refresh shows it off
    (the refresh is what hands the reliable store its topics)."""
    _cli(pg_dsn, "topic", "create", "orders", "--ordered")
    _cli(pg_dsn, "channel", "add", "orders", "billing")
    _cli(pg_dsn, "topic", "create", "plain")
    server = admin_server(make_server, registry_refresh="0.2s")

    def listed() -> dict:
        status, body = http(server, "GET", "/admin/topics")
        assert status == 200, body
        return {t["name"]: t["ordered"] for t in body["topics"]}

    assert listed() == {"orders": True, "plain": False}
    console = Console(server.admin_port)
    try:
        assert {t["name"]: t["ordered"] for t in console.data("topics")} == {"orders": True, "plain": False}
        _cli(pg_dsn, "topic", "update", "orders", "--no-ordered")
        _cli(pg_dsn, "topic", "update", "plain", "--ordered")
        wait_for(lambda: listed() == {"orders": False, "plain": True})
        assert {t["name"]: t["ordered"] for t in console.data("topics")} == {"orders": False, "plain": True}
    finally:
        console.close()


def test_the_web_console_marks_an_ordered_topic(make_server, pg_dsn, browser):  # noqa: F811
    """The topics page says ``ordered`` beside the store of each channel of an ordered topic
    and not beside the others; it follows an update at its next refresh, without a reload."""
    _cli(pg_dsn, "topic", "create", "orders", "--ordered")
    _cli(pg_dsn, "channel", "add", "orders", "billing")
    _cli(pg_dsn, "topic", "create", "plain")
    _cli(pg_dsn, "channel", "add", "plain", "c")
    server = make_server(registry_refresh="0.2s")
    page = Page(browser, server)
    page.open("#/")
    orders = "#topics tr[data-topic='orders'][data-channel='billing']"
    plain = "#topics tr[data-topic='plain'][data-channel='c']"

    def store(row: str) -> str:
        """The store cell's text but the line of what PostgreSQL keeps of the topic."""
        return page.text(row + " td:nth-child(2)").replace(page.text(row + " td:nth-child(2) .retained") or "", "")

    assert page.text(orders + " td:nth-child(2) .retained") == "keeps 0 messages, 0 bytes"
    assert store(orders) == "reliable ordered"
    assert page.text(orders + " .ordered") == " ordered"
    assert store(plain) == "reliable" and page.text(plain + " .ordered") is None
    page.shot("topics-ordered")
    _cli(pg_dsn, "topic", "update", "orders", "--no-ordered")
    wait_for(lambda: store(orders) == "reliable", timeout=20)
