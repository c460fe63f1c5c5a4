"""The web console in a real browser (Debian's chromium and chromium-driver through
selenium, installed by deploy/setup.sh) against a real server with real data: it lists
the topics, shows a depth that changes after publishing, replays a dead letter and sees
it delivered, traces a message, and refuses a change without admin rights. Each page is
saved as a screenshot under ``tmp/artifacts/console/`` (``DMQ_ARTIFACTS`` overrides the
folder) for a person to look at; docs/observability.md shows some of them."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from dmq_client.wire import Command

from .support import REPO, db_rows, scrape_metrics, wait_for

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,900")
ARTIFACTS = Path(os.environ.get("DMQ_ARTIFACTS") or REPO / "tmp" / "artifacts") / "console"
TOKEN = "console-s3cret"


#: a browser's time zone far from UTC (+05:45, no daylight saving): a local time read as UTC shows
BROWSER_ZONE = "Asia/Kathmandu"


@pytest.fixture
def browser():
    yield from _chromium()


@pytest.fixture
def browser_far_from_utc():
    """The browser with its clock in ``BROWSER_ZONE`` (chromium reads TZ)."""
    yield from _chromium({**os.environ, "TZ": BROWSER_ZONE})


def _chromium(env=None):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="dmq-chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER, env=env))
    driver.set_page_load_timeout(30)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


class Console:
    """The pages, as a person uses them: open a route, wait for it to load, read, click."""

    def __init__(self, driver, server):
        self.driver = driver
        self.base = f"{server.http}/console/"
        self.loads = 0

    def open(self, route: str = "#/") -> None:
        """A fresh load of the page (a new query string: the same URL would only move within
        the document), then wait until the route has rendered."""
        self.loads += 1
        self.driver.get(f"{self.base}?load={self.loads}{route}")
        self.loaded(route)

    def loaded(self, route: str) -> None:
        wait_for(lambda: self.driver.execute_script(
            "return document.getElementById('page').dataset.loaded") == route, timeout=15)

    def find(self, css: str):
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.CSS_SELECTOR, css)

    def finds(self, css: str):
        from selenium.webdriver.common.by import By

        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def text(self, css: str) -> str:
        """The element's text, read in the page (a refresh may replace the node meanwhile)."""
        return self.driver.execute_script(
            "const n = document.querySelector(arguments[0]); return n ? n.textContent : null;", css)

    def click(self, css: str) -> None:
        self.find(css).click()

    def confirm(self) -> str:
        wait_for(lambda: self.driver.execute_script("return document.getElementById('confirm').open"))
        text = self.text("#confirm-text")
        self.click("#confirm-yes")
        return text

    def status(self) -> str:
        return wait_for(lambda: self.text("#status-msg"))

    def shot(self, name: str) -> None:
        self.driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))

    def sign_in(self, token: str) -> None:
        self.find("#token").send_keys(token)
        self.click("#signin button")
        wait_for(lambda: self.text("#mode") == "admin")


def setup_data(pg_dsn):
    import registry
    from dmq_server.db.worker import connect

    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders", msg_timeout_ms=60000)
        registry.add_channel(conn, "orders", "billing")
        registry.add_channel(conn, "orders", "audit")
        registry.create_topic(conn, "payments", msg_timeout_ms=300, max_attempts=1)
        registry.add_channel(conn, "payments", "ledger")


def scrape(server) -> dict:
    return scrape_metrics(server.http)


def test_an_operator_sees_and_repairs_the_system_in_the_console(make_server, pg_dsn, browser):
    setup_data(pg_dsn)
    server = make_server(admin_token=TOKEN, channel_state_interval="0.3s", metrics_db_interval="0.3s",
                         delay_poll_interval="100ms")
    console = Console(browser, server)

    # -- topics, read-only without the token -------------------------------------------
    console.open("#/")
    assert console.text("#mode") == "read-only"
    rows = {(r.get_attribute("data-topic"), r.get_attribute("data-channel")) for r in console.finds("#topics tbody tr")}
    assert {("orders", "billing"), ("orders", "audit"), ("payments", "ledger")} <= rows
    audit_depth = "#topics tr[data-topic='orders'][data-channel='audit'] td.depth"
    assert console.text(audit_depth) == "0"
    with server.client() as producer:
        replies = producer.send_many("orders", [b'{"order": %d}' % i for i in range(7)])
        assert {r.command for r in replies} == {Command.SEND_SUCCESS_ACK}
        ordered = sorted(r.message_id for r in replies)  # two writers commit concurrently: ids interleave
        assert producer.send("payments", b'{"payment": "stuck"}').command == Command.SEND_SUCCESS_ACK
    # the page refreshes itself: the depth changes without a reload
    wait_for(lambda: console.text(audit_depth) == "7", timeout=20)
    console.shot("topics")

    # a change without admin rights: the button is there, the server refuses it
    console.click("#topics tr[data-topic='orders'][data-channel='audit'] button[data-action='pause']")
    assert "changes need the admin token" in console.status()
    overview = json.loads(urllib.request.urlopen(server.http + "/admin/overview", timeout=5).read())
    (audit,) = [c for t in overview["topics"] if t["topic"] == "orders" for c in t["channels"]
                if c["channel_name"] == "audit"]
    assert audit["paused"] is False
    console.shot("refused-read-only")

    # -- a dead letter: payments' consumer never acknowledges (300 ms timeout, 1 attempt) ----------
    from .support import NsqSocket

    ledger = NsqSocket(server.tcp_port, {"client_id": "ledger-1", "feature_negotiation": True})
    ledger.sub("payments", "ledger", rdy=1)
    stuck_id = int(ledger.message()[2], 16)
    wait_for(lambda: (console.open("#/dead-letters?reason=max_attempts"),
                      console.finds("#dead-letters tbody tr[data-letter-id]"))[1], timeout=20)
    console.click("#dead-letters tbody tr[data-letter-id] button[data-action='show']")
    wait_for(lambda: '"payment": "stuck"' in (console.text("#dead-letters pre.body") or ""))
    console.shot("dead-letters")

    # sign in, replay it from the browser (with its confirmation), and see it delivered
    console.sign_in(TOKEN)
    console.open("#/dead-letters?reason=max_attempts")
    console.click("input.pick")
    console.click("button[data-action='replay-selected']")
    assert console.confirm() == "Replay the 1 selected dead letters to their channels?"
    assert console.status() == "replayed 1"
    _, attempts, wire_id, body = ledger.message()  # delivered again, to its channel
    assert body == b'{"payment": "stuck"}' and attempts == 1
    replay_id = int(wire_id, 16)
    ledger.send(b"FIN " + wire_id + b"\n")
    console.open("#/audit")
    assert console.text("#audit tbody tr td:nth-child(4)") == "dlq.replay"
    console.shot("audit")

    # -- trace the dead message, then its replay -----------------------------------------------
    console.open(f"#/trace/{stuck_id}")
    kinds = [li.get_attribute("data-event") for li in console.finds("#timeline li")]
    assert kinds == ["stored", "delivered", "returned", "dead_letter", "replayed"]
    assert "not acknowledged in time" in console.text("#timeline li.returned")
    assert f"replayed as message {replay_id}" in console.text("#timeline li.replayed")
    console.shot("trace-dead-letter")
    wait_for(lambda: (console.open(f"#/trace/{replay_id}"),
                      [li.get_attribute("data-event") for li in console.finds("#timeline li")])[1][-1:] == ["acked"])
    assert "ledger-1" in console.text("#timeline li.acked")
    assert "replay of" in console.text("#trace-facts")
    console.shot("trace-replay")

    # -- the channel page: consumers and peek (nothing consumed) ------------------------------
    billing = NsqSocket(server.tcp_port, {"client_id": "billing-1", "feature_negotiation": True})
    billing.sub("orders", "billing", rdy=2)
    held = [billing.message() for _ in range(2)]
    console.open("#/channel/orders/billing")
    peeked = [int(r.get_attribute("data-message-id")) for r in console.finds("#peek tbody tr")]
    assert peeked == ordered
    states = [c.text for c in console.finds("#peek tbody tr td:nth-child(4)")]
    assert states[:2] == [f"in flight to nsq billing-1@127.0.0.1:{billing.sock.getsockname()[1]}"] * 2
    assert console.text("#consumers tbody td").startswith("nsq billing-1@")
    console.shot("channel")
    console.open("#/channel/orders/billing")  # peeking again changed nothing
    assert [int(r.get_attribute("data-message-id")) for r in console.finds("#peek tbody tr")] == ordered
    for _, _, wire_id, _ in held:
        billing.send(b"FIN " + wire_id + b"\n")

    # pause and unpause with rights
    console.open("#/")
    console.click("#topics tr[data-topic='orders'][data-channel='audit'] button[data-action='pause']")
    wait_for(lambda: console.text("#topics tr[data-topic='orders'][data-channel='audit'] .paused") == "paused")
    console.click("#topics tr[data-topic='orders'][data-channel='audit'] button[data-action='unpause']")
    wait_for(lambda: not console.text("#topics tr[data-topic='orders'][data-channel='audit'] .paused"))

    # -- the delay view and the nodes ----------------------------------------------------------
    from dmq_server.core.nsq_wire import encode_command

    delayed = NsqSocket(server.tcp_port)
    for minutes in (10, 25, 40):
        assert delayed.send(encode_command(b"DPUB", b"orders", str(minutes * 60000).encode(),
                                           body=b'{"in": "%d min"}' % minutes)).response() == b"OK"
    console.open("#/delay?topic=&width=10m")
    assert len(console.finds("#due-histogram rect")) == 3
    assert len(console.finds("#delayed tbody tr")) == 3
    console.shot("delay")
    console.open("#/nodes")
    node_id = console.text("#node")
    assert node_id.endswith(f":{server.tcp_port}")
    assert console.text("#nodes tbody tr td") == f"{node_id} (this node)"
    console.shot("nodes")

    # -- /metrics counted what the test did ----------------------------------------------------
    s = wait_for(lambda: (m := scrape(server))[("dmq_acks_durable_total", ())] == 3 and m)
    reliable = lambda topic, channel: (("channel", channel), ("store", "reliable"), ("topic", topic))  # noqa: E731
    assert s[("dmq_published_messages_total", (("store", "reliable"),))] == 8  # a replay comes through the delay table
    assert s[("dmq_channel_messages_total", reliable("orders", "audit"))] == 7
    assert s[("dmq_channel_acked_messages_total", reliable("orders", "billing"))] == 2
    assert s[("dmq_channel_delivered_messages_total", reliable("payments", "ledger"))] == 2
    assert s[("dmq_returned_deliveries_total", (("reason", "timeout"),))] == 1
    assert s[("dmq_dead_lettered_messages_total", (("reason", "max_attempts"),))] == 1
    assert s[("dmq_delay_pending", (("topic", "orders"),))] == 3
    for sock in (ledger, billing, delayed):
        sock.close()


#: a header value holding markup: the console must show it as typed, never run or render it
MARKUP = '<script>window.pwned = 1</script><b id="bold">bold</b>'


def _properties_shown(console, css: str) -> dict:
    """What the page shows of a message's properties inside ``css``: the facts (dt -> dd
    text) or a row's cells, the headers' name/value list, and what the markup became."""
    return console.driver.execute_script(
        """const root = document.querySelector(arguments[0]);
        const headers = root.querySelector("dl.headers");
        const pairs = headers ? [...headers.querySelectorAll("dt")].map((dt) => [dt.textContent, dt.nextElementSibling.textContent]) : [];
        const facts = Object.fromEntries([...root.querySelectorAll(":scope > dt")].map((dt) => [dt.textContent, dt.nextElementSibling.textContent]));
        const cell = (c) => { const n = root.querySelector(c); return n ? n.textContent : null; };
        return { facts, key: cell("td.key"), priority: cell("td.priority"), headers: pairs,
                 scripts: root.querySelectorAll("script").length, bold: root.querySelectorAll("b").length,
                 pwned: window.pwned === undefined ? null : String(window.pwned) };""", css)


def test_the_trace_peek_and_delay_views_show_a_messages_properties_as_text(make_server, pg_dsn, browser):
    """A message sent with a key, a priority and headers (one header's value is HTML with a
    script) shows them in its trace, in its channel's peek and, delayed, in the delay view:
    key and priority as fields, the headers as a name/value list, the markup as text (no
    script element, nothing run); a message without them shows none (issue 45)."""
    from dmq_client.wire import MessageType
    from dmq_client.wire.properties import Properties

    setup_data(pg_dsn)
    server = make_server(delay_poll_interval="100ms")
    console = Console(browser, server)
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    headers = {"tenant": "caf\u00e9", "x-note": MARKUP, "traceparent": traceparent}
    with server.client() as producer:
        sent = producer.send("orders", b'{"order": 7}', key="order-7", priority=5, headers=headers)
        plain = producer.send("orders", b"plain")
        assert sent.command == plain.command == Command.SEND_SUCCESS_ACK, sent.status
        later = producer.send_frame("orders", b"later", properties=Properties("later-1", 9, {"x-note": MARKUP}))
        later.msg_type, later.due_ms = MessageType.DELAY, int(time.time() * 1000) + 3_600_000
        producer.write(later)
        assert producer.next_send_reply(timeout=10).command == Command.SEND_SUCCESS_ACK
    # the trace: key and priority among the facts, the headers as a list
    console.open(f"#/trace/{sent.message_id}")
    shown = _properties_shown(console, "#trace-facts")
    assert (shown["facts"]["key"], shown["facts"]["priority"]) == ("order-7", "5")
    # the trace id its traceparent names (dmq_client.otel), to look up in the tracing backend
    assert shown["facts"]["trace id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert sorted(shown["headers"]) == [["tenant", "caf\u00e9"], ["traceparent", traceparent], ["x-note", MARKUP]]
    assert (shown["scripts"], shown["bold"], shown["pwned"]) == (0, 0, None)
    console.shot("trace-properties")
    console.open(f"#/trace/{plain.message_id}")
    shown = _properties_shown(console, "#trace-facts")
    assert (shown["facts"]["key"], shown["facts"]["priority"], shown["facts"]["headers"]) == ("\u2013", "0", "\u2013")
    assert "trace id" not in shown["facts"]
    # peek: the waiting copies of audit (nobody subscribed), each row with its properties
    console.open("#/channel/orders/audit")
    shown = _properties_shown(console, f"#peek tr[data-message-id='{sent.message_id}']")
    assert (shown["key"], shown["priority"]) == ("order-7", "5")
    assert sorted(shown["headers"]) == [["tenant", "caf\u00e9"], ["traceparent", traceparent], ["x-note", MARKUP]]
    assert (shown["scripts"], shown["bold"], shown["pwned"]) == (0, 0, None)
    shown = _properties_shown(console, f"#peek tr[data-message-id='{plain.message_id}']")
    assert (shown["key"], shown["priority"], shown["headers"]) == ("\u2013", "0", [])
    console.shot("peek-properties")
    # the delay view: the entry waiting an hour, with the properties its message will have
    console.open("#/delay?topic=orders&width=10m")
    shown = _properties_shown(console, "#delayed tbody tr")
    assert (shown["key"], shown["priority"], shown["headers"]) == ("later-1", "9", [["x-note", MARKUP]])
    assert (shown["scripts"], shown["bold"], shown["pwned"]) == (0, 0, None)
    console.shot("delay-properties")


def _post(server, path: str, body: bytes = b"") -> bytes:
    request = urllib.request.Request(server.http + path, data=body, method="POST",
                                     headers={"Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return reply.read()


def _seconds(shown: str) -> int:
    """The console's age ("7 s"), as a number; fails on anything else ("–")."""
    number, unit = shown.split(" ")
    assert unit == "s", shown
    return int(number)


def test_every_fast_topic_and_how_long_messages_wait(make_server, pg_dsn, browser):
    """A fast topic without channels is listed (nsqadmin lists it), with what waits in it
    for its first channel; "Oldest" gives the age of a channel's oldest waiting message for
    both stores. --metrics-db-interval is an hour: the reliable channel's age must follow
    its depth, not wait for that timer."""
    setup_data(pg_dsn)
    server = make_server(channel_state_interval="0.3s", metrics_db_interval="1h", mem_queue_size="100",
                         sweep_interval="0.5s")
    started = time.monotonic()
    batch = b"\n".join(b'{"n": %d}' % i for i in range(500))
    assert _post(server, "/mpub?topic=orders", batch) == b"OK"  # reliable: billing, audit
    assert _post(server, "/topic/create?topic=lonely") == b""
    assert _post(server, "/mpub?topic=lonely", b"a\nb\nc") == b"OK"
    assert _post(server, "/topic/create?topic=events") == b""
    assert _post(server, "/channel/create?topic=events&channel=tail") == b""
    assert _post(server, "/mpub?topic=events", batch) == b"OK"  # 100 in memory, 400 on disk
    console = Console(browser, server)
    console.open("#/")

    lonely = "#topics tr[data-topic='lonely'][data-store='fast']"
    assert console.text(lonely + " td.depth") == "3"
    assert "wait in the topic for its first channel" in console.text(lonely)
    tail = "#topics tr[data-topic='events'][data-channel='tail']"
    assert console.text(tail + " td.depth") == "500"
    assert 0 <= _seconds(console.text(tail + " td.oldest")) <= time.monotonic() - started + 1
    billing = "#topics tr[data-topic='orders'][data-channel='billing']"
    wait_for(lambda: console.text(billing + " td.depth") == "500", timeout=20)
    shown = wait_for(lambda: (text := console.text(billing + " td.oldest")) != "–" and text, timeout=20)
    assert 0 <= _seconds(shown) <= time.monotonic() - started + 1
    console.shot("topics-fast-and-oldest")
    # what PostgreSQL keeps of the reliable topic: counted by the sweep's passes once the
    # messages are settled (published over a minute ago: the count's lag), 500 bodies of 8 to
    # 10 bytes (4,890)
    db_rows(pg_dsn, "UPDATE dmq_message SET published_at = now() - interval '5 minutes' RETURNING 1")
    orders = "#topics tr[data-topic='orders']"
    wait_for(lambda: console.open("#/") or "keeps 500 messages, 4.8 KiB" in console.text(orders), timeout=30)


def test_the_dead_letter_page_shows_each_letters_key_priority_and_headers(make_server, pg_dsn, browser):
    """A dead letter of a message sent with a key, a priority and headers shows the key and
    the priority in its row and the headers above its body; one without shows none (issue 45)."""
    setup_data(pg_dsn)
    server = make_server()
    console = Console(browser, server)
    with server.client() as producer, server.client() as consumer:
        sent = producer.send("payments", b'{"payment": 7}', key="order-7", priority=5,
                             headers={"content-type": "application/json", "tenant": "caf\u00e9"})
        assert sent.command == Command.SEND_SUCCESS_ACK, sent.status
        assert producer.send("payments", b"plain").command == Command.SEND_SUCCESS_ACK
        assert consumer.subscribe("payments", "ledger").command == Command.SUBSCRIBE_ACK
        assert {consumer.receive(timeout=5).body for _ in range(2)} == {b'{"payment": 7}', b"plain"}  # never acked
        row = "#dead-letters tbody tr[data-letter-id]"  # connected until they time out: no requeue
        wait_for(lambda: (console.open("#/dead-letters?reason=max_attempts"), len(console.finds(row)) == 2)[1],
                 timeout=20)
    cells = console.driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map((r) => [r.dataset.letterId,"
        " r.querySelector('td.key').textContent, r.querySelector('td.priority').textContent]);", row)
    assert sorted(c[1:] for c in cells) == [["order-7", "5"], ["\u2013", "0"]]
    keyed = next(letter_id for letter_id, key, _ in cells if key == "order-7")
    console.click(f"#dead-letters tr[data-letter-id='{keyed}'] button[data-action='show']")
    wait_for(lambda: '{"payment": 7}' in (console.text("#dead-letters tr.sub:not([hidden]) pre.body") or ""))
    assert console.text("#dead-letters tr.sub:not([hidden]) pre.body").startswith(
        "tenant: caf\u00e9\ncontent-type: application/json\n\n{\"payment\": 7}")
    console.shot("dead-letters-properties")


def _pending(pg_dsn, channel: str) -> list[int]:
    from .support import db_rows

    return [r[0] for r in db_rows(pg_dsn, "SELECT message_id FROM dmq_pending WHERE channel = %s ORDER BY 1", channel)]


def _seek_with_the_form(console, kind: str, value: str) -> None:
    """Fill the channel page's seek form (a kind of target and its value) and press Seek."""
    from selenium.webdriver.support.ui import Select

    Select(console.find("#seek-form select[name='kind']")).select_by_value(kind)
    field = console.find(f"#seek-form input[name='{kind}']")
    field.clear()
    field.send_keys(value)
    console.click("#seek-form button[data-action='seek']")


def test_an_operator_seeks_a_channel_in_the_console(make_server, pg_dsn, browser_far_from_utc):
    """The channel page's seek form (issue 46): ten messages acknowledged on billing, its
    consumer still connected. Read-only, the Seek button is marked and the server refuses
    even the dry run; signed in, a seek to the fifth id asks with the dry run's count and
    first id, and after the confirmation the consumer receives exactly those six again and
    nothing else; the audit page lists the seek; a time in the browser's zone and a duration
    ago ask with the dry run of the right instant; bad targets show the server's message."""
    from datetime import datetime, timezone
    from zoneinfo import ZoneInfo

    from selenium.webdriver.support.ui import Select

    from .support import db_rows

    setup_data(pg_dsn)
    server = make_server(admin_token=TOKEN, channel_state_interval="0.3s")
    console = Console(browser_far_from_utc, server)
    with server.client() as producer:
        replies = producer.send_many("orders", [b'{"order": %d}' % i for i in range(10)])
        assert {r.command for r in replies} == {Command.SEND_SUCCESS_ACK}
    ordered = sorted(r.message_id for r in replies)
    with server.client() as billing:
        assert billing.subscribe("orders", "billing", credit=50).command == Command.SUBSCRIBE_ACK
        for _ in ordered:
            push = billing.receive(timeout=15)
            assert push is not None
            billing.ack(push)
        wait_for(lambda: not _pending(pg_dsn, "billing"), timeout=15)
        target = ordered[4]

        # read-only: the button is there, marked; the server refuses the dry run, nothing moves
        console.open("#/channel/orders/billing")
        assert "needs-admin" in console.find("#seek-form button[data-action='seek']").get_attribute("class")
        _seek_with_the_form(console, "id", str(target))
        assert "changes need the admin token" in console.status()
        assert not console.driver.execute_script("return document.getElementById('confirm').open")
        assert _pending(pg_dsn, "billing") == []

        # signed in: the confirmation gives the dry run's count, then the seek
        console.sign_in(TOKEN)
        console.open("#/channel/orders/billing")
        _seek_with_the_form(console, "id", str(target))
        [(published_ms,)] = db_rows(pg_dsn, "SELECT (extract(epoch FROM published_at) * 1000)::bigint "
                                            "FROM dmq_message WHERE id = %s", target)
        shown = datetime.fromtimestamp(published_ms // 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        assert console.confirm() == (f"6 messages of orders will be delivered again to billing only; "
                                     f"from id {target} ({shown}.{published_ms % 1000:03d} UTC).")
        assert console.status() == "sought orders/billing: 6 messages to deliver again, epoch 1"
        console.shot("channel-seek")
        again = []
        for _ in range(6):
            push = billing.receive(timeout=15)
            assert push is not None, f"only {again} delivered again"
            again.append(push.message_id)
            billing.ack(push)
        assert sorted(again) == ordered[4:]  # exactly those, each once
        assert billing.receive(timeout=1.5) is None  # and nothing else
    assert len(_pending(pg_dsn, "audit")) == 10  # the other channel: untouched

    console.open("#/audit")
    cells = [c.text for c in console.finds("#audit tbody tr:first-child td")]
    assert cells[1:] == ["http", cells[2], "channel.seek", f"orders/billing to id {target}", "6"]
    console.shot("audit-seek")

    # a time (the browser's local time: a minute before the first message) and a duration ago:
    # the dry run's count in the confirmation; cancelled, nothing changes
    def first_published(message_id: int) -> int:
        return db_rows(pg_dsn, "SELECT (extract(epoch FROM published_at) * 1000)::bigint FROM dmq_message "
                               "WHERE id = %s", message_id)[0][0]

    first_ms = first_published(ordered[0])
    first = datetime.fromtimestamp(first_ms // 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    local = datetime.fromtimestamp(first_ms / 1000 - 60, tz=ZoneInfo(BROWSER_ZONE)).strftime("%Y-%m-%dT%H:%M:%S")
    console.open("#/channel/orders/billing")
    assert console.driver.execute_script("return new Date().getTimezoneOffset()") == -345  # UTC+05:45
    for kind, value in (("time", local), ("ago", "1h")):
        if kind == "time":  # a datetime-local input takes its value as the browser's own spelling
            console.driver.execute_script(
                "const input = document.querySelector(\"#seek-form input[name='time']\");"
                "const kind = document.querySelector(\"#seek-form select[name='kind']\");"
                "kind.value = 'time'; kind.dispatchEvent(new Event('change'));"
                "input.value = arguments[0]; input.dispatchEvent(new Event('input'));"
                "document.querySelector(\"#seek-form button[data-action='seek']\").click();", value)
        else:
            _seek_with_the_form(console, kind, value)
        wait_for(lambda: console.driver.execute_script("return document.getElementById('confirm').open"))
        assert console.text("#confirm-text") == (f"10 messages of orders will be delivered again to billing only; "
                                                 f"from id {ordered[0]} ({first}.{first_ms % 1000:03d} UTC)."), kind
        console.click("#confirm-no")
    wait_for(lambda: not _pending(pg_dsn, "billing"), timeout=15)  # the replay's acks; the dry runs changed nothing
    assert db_rows(pg_dsn, "SELECT epoch FROM dmq_channel WHERE topic = 'orders' AND name = 'billing'") == [(1,)]

    # the latest, on audit (its ten copies wait, nobody subscribed): nothing again, what waits is skipped
    console.open("#/channel/orders/audit")
    Select(console.find("#seek-form select[name='kind']")).select_by_value("latest")
    console.click("#seek-form button[data-action='seek']")
    assert console.confirm() == "No message of orders will be delivered again to audit; the messages waiting in it now are skipped."
    assert console.status() == "sought orders/audit: 0 messages to deliver again, epoch 1"
    assert _pending(pg_dsn, "audit") == []

    # targets the server cannot take: its message, as the other actions show errors; no confirmation
    def refused(before: str) -> str:
        return wait_for(lambda: (text := console.text("#status-msg")) != before and text)

    # (what the form holds outlives the page's refresh every 5 s)
    console.open("#/channel/orders/billing")
    Select(console.find("#seek-form select[name='kind']")).select_by_value("id")
    console.find("#seek-form input[name='id']").send_keys("0")
    console.driver.execute_script("document.activeElement.blur(); window.shownForm = document.getElementById('seek-form');")
    wait_for(lambda: console.driver.execute_script(
        "return document.getElementById('seek-form') !== window.shownForm && document.getElementById('page').dataset.loaded"), timeout=15)
    assert console.driver.execute_script(
        "const form = document.getElementById('seek-form');"
        "return [form.elements.kind.value, form.elements.id.value, form.querySelector('label[data-kind=id]').hidden];") == ["id", "0", False]
    console.click("#seek-form button[data-action='seek']")
    assert (said := console.status()) == "E_INVALID: to_id: '0' is not a message id (a positive integer below 2^63)"
    _seek_with_the_form(console, "ago", "a while")
    assert (said := refused(said)).startswith("E_INVALID: to_time: ")
    console.driver.execute_script(
        "const input = document.querySelector(\"#seek-form input[name='time']\");"
        "document.querySelector(\"#seek-form select[name='kind']\").value = 'time';"
        "document.querySelector(\"#seek-form select[name='kind']\").dispatchEvent(new Event('change'));"
        "input.value = '2999-01-01T00:00'; input.dispatchEvent(new Event('input'));"
        "document.querySelector(\"#seek-form button[data-action='seek']\").click();")
    assert "after now" in refused(said)  # the datetime-local value, read as local time, sent as Unix ms
    assert not console.driver.execute_script("return document.getElementById('confirm').open")
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_admin_log WHERE operation = 'channel.seek'") == [(2,)]  # the two seeks, no dry run, no refusal
