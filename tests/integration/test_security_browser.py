"""A real browser (Debian's chromium, headless, through selenium) on a page of another
origin, served by a second HTTP server, tries to change dmq through the operator's browser:
an HTML form post and ``fetch()`` posts (``no-cors``, and a simple CORS request, whose
answer the page may not read but which is sent) to ``/pub``, ``/topic/delete`` and the
admin API's dead-letter delete. Chromium tells dmq where each came from in three ways,
each a case: a page on another port of 127.0.0.1 (``Sec-Fetch-Site: same-site``), a page
on ``localhost`` (``cross-site``), and names that are no trustworthy origin, to which
Chromium sends no Fetch metadata, only ``Origin`` (``evil.test`` and ``dmq.test``, both
resolved to 127.0.0.1 by the browser). Every one reaches dmq and is refused 403
E_CROSS_SITE with the reason; the server's state shows nothing published, deleted or
emptied. The same requests from dmq's own origin (a script on the console's page) are
done."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from .support import wait_for
from .test_console_browser import CHROMEDRIVER, CHROMIUM, FLAGS
from .test_security_http import call

pytestmark = pytest.mark.integration

#: what the page of another origin posts to, on dmq
TARGETS = ("/pub?topic=forged", "/topic/delete?topic=kept", "/admin/dead-letters/delete?all=true")

FORM_PAGE = """<!doctype html><html><body>
<form id="f" method="POST" action="{action}"><input name="message" value="forged"></form>
<script>document.getElementById("f").submit();</script></body></html>"""

FETCH_PAGE = """<!doctype html><html><body><script>
const urls = {urls};
Promise.allSettled(urls.flatMap(url => [
  fetch(url, {{method: "POST", mode: "no-cors", body: "forged"}}),
  fetch(url, {{method: "POST", body: "forged"}}),
])).then(() => {{ document.title = "sent"; }});
</script></body></html>"""

#: run on dmq's own page: (status, body) of a POST, or the error
OWN_POST = """const done = arguments[arguments.length - 1];
fetch(arguments[0], {method: "POST", body: "mine"})
  .then(reply => reply.text().then(text => done([reply.status, text])), error => done(["error", String(error)]));"""


@pytest.fixture
def other_origin():
    """A second HTTP server: ``pages[path]`` is the HTML it serves at ``path``."""
    pages: dict[str, str] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            data = pages.get(self.path, "").encode()
            self.send_response(200 if self.path in pages else 404)
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
        yield pages, httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, "--host-resolver-rules=MAP *.test 127.0.0.1"):
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="dmq-chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _state(server) -> dict:
    """What the forged requests would have changed, read from the server."""
    def topic(name):
        topics = json.loads(call(server.http + f"/stats?format=json&topic={name}")[1])["topics"]
        return topics[0]["message_count"] if topics else None

    letters = json.loads(call(server.http + "/admin/dead-letters")[1])["dead_letters"]
    return {"kept": topic("kept"), "forged": topic("forged"), "dead letters": [d["detail"] for d in letters]}


def _refusals(server, path: str) -> int:
    log = server.log_path.read_text(errors="replace")
    return sum(1 for line in log.splitlines()
               if f"HTTP POST {path} from " in line and "refused 403 E_CROSS_SITE" in line)


@pytest.mark.parametrize(
    "page_host, dmq_host, told_by",
    [
        ("127.0.0.1", "127.0.0.1", "same-site"),  # another port of the same host
        ("localhost", "127.0.0.1", "cross-site"),
        ("evil.test", "dmq.test", "Origin"),  # not a trustworthy origin: no Fetch metadata
    ],
)
def test_a_page_of_another_origin_cannot_publish_delete_or_empty(make_server, other_origin, browser,
                                                                 page_host, dmq_host, told_by):
    server = make_server(broadcast_address="dmq.test")  # a name of this node's: its Host passes
    dmq = f"http://{dmq_host}:{server.http_port}"
    urllib.request.urlopen(urllib.request.Request(server.http + "/pub?topic=kept", b"kept", method="POST"), timeout=10)
    report = json.dumps({"topic": "t", "producer": "p", "session_id": 1, "body": "x", "detail": "kept"}).encode()
    assert call(server.http + "/admin/dead-letters", "POST", report, **{"Content-Type": "application/json"})[0] == 200
    before = _state(server)
    assert before == {"kept": 1, "forged": None, "dead letters": ["kept"]}
    pages, port = other_origin
    page = f"http://{page_host}:{port}"
    why = {
        "same-site": "a page of another origin on the same site (another port or subdomain) sent this change "
                     "(Sec-Fetch-Site: same-site); only this listener's own pages may",
        "cross-site": "a page of another site sent this change (Sec-Fetch-Site: cross-site); only this "
                      "listener's own pages may",
        "Origin": f"a page of {page} sent this change (Origin), not one of this listener's {dmq}",
    }[told_by]

    for i, target in enumerate(TARGETS):  # a form post navigates: the browser shows dmq's answer
        pages[f"/form{i}"] = FORM_PAGE.format(action=dmq + target)
        browser.get(f"{page}/form{i}")
        wait_for(lambda: browser.current_url.startswith(dmq), timeout=20)
        answer = json.loads(browser.find_element("tag name", "body").text)
        admin_api = "/admin/" in target  # its answers are {"error", "message"}, nsqd's {"message"}
        assert answer == ({"error": "E_CROSS_SITE", "message": why} if admin_api
                          else {"message": f"E_CROSS_SITE {why}"}), target
    pages["/fetch"] = FETCH_PAGE.format(urls=json.dumps([dmq + target for target in TARGETS]))
    browser.get(f"{page}/fetch")
    wait_for(lambda: browser.title == "sent", timeout=20)

    for target in TARGETS:  # all three posts to each reached dmq and were refused
        path = target.split("?")[0]
        wait_for(lambda: _refusals(server, path) == 3, timeout=10)
    assert _state(server) == before

    browser.get(f"{dmq}/console/")  # dmq's own origin: the same posts are done
    for target in TARGETS:
        status, body = browser.execute_async_script(OWN_POST, target)
        assert status == 200, (target, body)
    assert _state(server) == {"kept": None, "forged": 1, "dead letters": []}
