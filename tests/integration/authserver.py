"""A tiny real auth server, nsqd's contract, run by a test: answers per secret, a record of
every request, and answers the test changes while it runs."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


class AuthServer:
    """``answers[secret]`` is ``(status, body)``; an unknown secret gets 403."""

    def __init__(self):
        self.answers: dict[str, tuple[int, object]] = {}
        self.requests: list[dict[str, str]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
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
                with outer.lock:
                    outer.requests.append(query)
                    status, body = outer.answers.get(query.get("secret", ""), (403, {"message": "NOT_AUTHORIZED"}))
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

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
        self.httpd.shutdown()
        self.httpd.server_close()


def grant(topic: str, channels=(".*",), permissions=("publish", "subscribe")) -> dict:
    return {"topic": topic, "channels": list(channels), "permissions": list(permissions)}
