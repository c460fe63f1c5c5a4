"""A tiny real auth server, nsqd's contract, run by a test: answers per secret, a record of
every request, and answers the test changes while it runs.

It frames its answers as the test asks (``framing``, for the whole server or one secret):
with a ``Content-Length`` (``LENGTH``), chunked (``CHUNKED``), or as HTTP/1.0 without a
length, the body ended by closing the connection (``CLOSE``: what an auth server written on
Python's ``http.server`` sends, and what Go's client, nsqd's, reads as whole). ``CUT_LENGTH``
and ``CUT_CHUNKED`` declare a body and close the connection before its end (a server that
died mid-answer). A secret in ``held`` is not answered until the server stops (an auth
server that hangs)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

LENGTH, CHUNKED, CLOSE, CUT_LENGTH, CUT_CHUNKED = "length", "chunked", "close", "cut-length", "cut-chunked"


class AuthServer:
    """``answers[secret]`` is ``(status, body)``; an unknown secret gets 403."""

    def __init__(self, framing: str = LENGTH):
        self.answers: dict[str, tuple[int, object]] = {}
        self.framing = framing
        self.framings: dict[str, str] = {}  # per secret, over the server's framing
        self.held: set[str] = set()
        self.released = threading.Event()
        self.requests: list[dict[str, str]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # http.server's default: the connection closes after the answer

            def do_GET(self):  # noqa: N802
                url = urlsplit(self.path)
                self._answer(url.path, parse_qs(url.query, keep_blank_values=True))

            def do_POST(self):  # noqa: N802
                size = int(self.headers.get("content-length") or 0)
                form = parse_qs(self.rfile.read(size).decode(), keep_blank_values=True)
                self._answer(urlsplit(self.path).path, form)

            def _answer(self, path, fields):
                query = {k: v[0] for k, v in fields.items()}
                query["_method"], query["_path"] = self.command, path
                secret = query.get("secret", "")
                with outer.lock:
                    outer.requests.append(query)
                    status, body = outer.answers.get(secret, (403, {"message": "NOT_AUTHORIZED"}))
                    framing = outer.framings.get(secret, outer.framing)
                    held = secret in outer.held
                if held:
                    outer.released.wait(60)
                    return
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self._send(status, data, framing)

            def _send(self, status: int, data: bytes, framing: str) -> None:
                if framing in (CHUNKED, CUT_CHUNKED):
                    self.protocol_version = "HTTP/1.1"  # chunked needs it; this answer only
                self.send_response(status)
                self.send_header("content-type", "application/json")
                if framing in (LENGTH, CUT_LENGTH):
                    declared = len(data) + (100 if framing == CUT_LENGTH else 0)
                    self.send_header("content-length", str(declared))
                if framing in (CHUNKED, CUT_CHUNKED):
                    self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                if framing in (CHUNKED, CUT_CHUNKED):
                    half = max(1, len(data) // 2)
                    chunks = [data[:half], data[half:]] if framing == CHUNKED else [data[:half]]
                    for chunk in chunks:
                        if chunk:
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    if framing == CHUNKED:
                        self.wfile.write(b"0\r\n\r\n")
                else:
                    self.wfile.write(data)
                self.close_connection = True

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def allow(self, secret: str, identity: str, authorizations: list[dict], ttl: int = 3600, **extra) -> None:
        with self.lock:
            self.answers[secret] = (200, {"ttl": ttl, "identity": identity, "identity_url": f"https://id/{identity}",
                                          "authorizations": authorizations, **extra})

    def count(self, secret: str | None = None) -> int:
        with self.lock:
            return sum(1 for r in self.requests if secret is None or r.get("secret") == secret)

    def __enter__(self) -> "AuthServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.released.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def grant(topic: str, channels=(".*",), permissions=("publish", "subscribe")) -> dict:
    return {"topic": topic, "channels": list(channels), "permissions": list(permissions)}
