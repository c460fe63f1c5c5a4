"""A real browser (Debian's chromium, headless, through selenium) on a page of another
origin tries what the issue found: a form post (text/plain body) to the admin API that
deletes every dead letter, and a no-cors fetch that publishes. Both reach dmq and are
refused; the dead letter survives and nothing is published."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from .support import wait_for
from .test_security_http import call

EVIL_PAGE = """<!doctype html><html><body>
<form id="f" method="POST" enctype="text/plain" action="{dmq}/admin/dead-letters/delete?all=true">
<input name="x" value="y"></form>
<script>
fetch("{dmq}/pub?topic=forged", {{method: "POST", mode: "no-cors", body: "forged"}})
  .finally(() => {{ document.title = "fetched"; document.getElementById("f").submit(); }});
</script></body></html>"""


@pytest.fixture
def evil_site():
    """A page on another origin (another port of 127.0.0.1)."""
    page = {"html": ""}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            data = page["html"].encode()
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield page, f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def test_a_cross_site_page_cannot_delete_dead_letters_or_publish(make_server, evil_site, browser):
    server = make_server()
    report = json.dumps({"topic": "t", "producer": "p", "session_id": 1, "body": "x", "detail": "kept"}).encode()
    assert call(server.http + "/admin/dead-letters", "POST", report,
                **{"Content-Type": "application/json", "X-Requested-By": "test"})[0] == 200
    page, url = evil_site
    page["html"] = EVIL_PAGE.format(dmq=server.http)
    browser.get(url)
    # the form's navigation lands on dmq's answer: the refusal
    wait_for(lambda: browser.current_url.startswith(server.http), timeout=20)
    answer = json.loads(browser.find_element("tag name", "body").text)
    assert answer["error"] == "E_CROSS_SITE" and "cross-origin request from http://127.0.0.1" in answer["message"]
    letters = json.loads(call(server.http + "/admin/dead-letters")[1])["dead_letters"]
    assert [letter["detail"] for letter in letters] == ["kept"]
    stats = json.loads(call(server.http + "/stats?format=json")[1])
    assert not [t for t in stats["topics"] if t["topic_name"] == "forged"]
    log = server.log()
    assert "POST /admin/dead-letters/delete" in log and "POST /pub" in log  # both reached dmq, both refused
