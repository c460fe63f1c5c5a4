"""HTTP bodies over the limit, on real sockets against a real server (http/site.py): the
``413`` is decided from the headers, before any of the body is sent, and the connection is
closed; a chunked body is cut off once it passes the limit; the server's memory does not
grow by the body. ``/pub`` allows ``--max-msg-size`` (nsqd's ``MSG_TOO_BIG``), ``/mpub``
and the other paths ``--max-body-size`` (``BODY_TOO_BIG``), as nsqd.

Every wait is on an event (the answer's bytes, the server's FIN) with a bound: the
socket's timeout, which fails the test if the server keeps waiting for the body."""

from __future__ import annotations

import json
import socket
import ssl
import time
import urllib.error
import urllib.request

import pytest

from .support import free_port

pytestmark = pytest.mark.integration

MB = 1024 * 1024
DECLARED = 64 * MB
#: the bound on every wait for the server: it answers in milliseconds
PROMPT = 5.0


def peak(server) -> int:
    """The most memory the server process has held at once so far, in bytes (``/proc``'s
    VmHWM): a body read and then dropped still shows in it."""
    with open(f"/proc/{server.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def headers(path: bytes, length: int | None = None, *extra: bytes) -> bytes:
    lines = [b"POST " + path + b" HTTP/1.1", b"Host: 127.0.0.1", b"Content-Type: application/octet-stream", *extra]
    if length is not None:
        lines.append(b"Content-Length: %d" % length)
    return b"\r\n".join(lines) + b"\r\n\r\n"


def read_answer(sock: socket.socket) -> tuple[bytes, float, bool]:
    """The whole answer up to the server's FIN (within PROMPT), how long the first byte
    took, and whether the server closed its side."""
    sock.settimeout(PROMPT)
    started = time.monotonic()
    first = sock.recv(65536)  # the event: the server answered (socket.timeout fails the test)
    took = time.monotonic() - started
    answer, closed = first, False
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            closed = True
            break
        answer += chunk
    return answer, took, closed


def refused_from_headers(port: int, request: bytes, wrap=lambda raw: raw) -> tuple[bytes, float, bool]:
    with socket.create_connection(("127.0.0.1", port), timeout=PROMPT) as raw, wrap(raw) as sock:
        sock.sendall(request)  # the headers alone: not a byte of the body
        return read_answer(sock)


@pytest.mark.parametrize("path, message", [
    (b"/pub?topic=big", b"MSG_TOO_BIG"),  # --max-msg-size
    (b"/pub/?topic=big", b"MSG_TOO_BIG"),  # what twisted.web routes to /pub, by the same limit
    (b"//pub?topic=big", b"MSG_TOO_BIG"),
    (b"/%70ub?topic=big", b"MSG_TOO_BIG"),
    (b"/mpub?topic=big", b"BODY_TOO_BIG"),  # --max-body-size
])
def test_a_body_declared_too_large_is_refused_from_its_headers(make_server, path, message):
    server = make_server()
    before = peak(server)
    answer, took, closed = refused_from_headers(server.http_port, headers(path, DECLARED))
    assert answer.startswith(b"HTTP/1.1 413 Request Entity Too Large\r\n"), answer
    assert answer.endswith(b'{"message": "' + message + b'"}') and b"Connection: close" in answer
    assert closed and took < PROMPT
    assert peak(server) - before < 16 * MB  # nothing of the 64 MB was held


def test_pub_and_mpub_have_their_own_limits(make_server):
    """2 MB: over --max-msg-size (1 MB), under --max-body-size (5 MB). /pub refuses it from
    the headers; /mpub reads it, two messages of 1,000,000 bytes, and publishes them."""
    server = make_server()
    answer, _, closed = refused_from_headers(server.http_port, headers(b"/pub?topic=two", 2 * MB))
    assert answer.startswith(b"HTTP/1.1 413 ") and answer.endswith(b'{"message": "MSG_TOO_BIG"}') and closed
    body = b"a" * 1_000_000 + b"\n" + b"b" * 1_000_000
    request = urllib.request.Request(server.http + "/mpub?topic=two", data=body,
                                     headers={"Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(request, timeout=PROMPT) as reply:
        assert reply.read() == b"OK"


def test_a_client_that_sends_the_whole_body_gets_the_413_and_the_server_keeps_none_of_it(make_server):
    """urllib sends the body before it reads (no 100-continue): it still gets the 413,
    and the 64 MB went nowhere in the server."""
    server = make_server()
    before = peak(server)
    request = urllib.request.Request(server.http + "/pub?topic=big", data=b"x" * DECLARED,
                                     headers={"Content-Type": "application/octet-stream"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=PROMPT)
    assert refused.value.code == 413 and json.loads(refused.value.read()) == {"message": "MSG_TOO_BIG"}
    assert peak(server) - before < 16 * MB


def test_a_chunked_body_is_cut_off_at_the_limit(make_server):
    """No length in the headers: the server counts the chunks and answers once they pass
    --max-msg-size, though the body has not ended."""
    server = make_server(max_msg_size=100_000)
    chunk = b"x" * 30_000
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=PROMPT) as sock:
        sock.sendall(headers(b"/pub?topic=big", None, b"Transfer-Encoding: chunked"))
        for _ in range(4):  # 120,000 bytes: the fourth chunk passes the limit
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        answer, took, closed = read_answer(sock)  # no last chunk sent: the body never ends
    assert answer.startswith(b"HTTP/1.1 413 ") and answer.endswith(b'{"message": "MSG_TOO_BIG"}')
    assert closed and took < PROMPT


def test_https_refuses_from_the_headers_too(make_server, certs):
    https_port = free_port()
    server = make_server(https_address=f"127.0.0.1:{https_port}", **certs.server_flags())
    context = ssl.create_default_context(cafile=str(certs.ca_file))
    answer, took, closed = refused_from_headers(
        https_port, headers(b"/pub?topic=big", DECLARED),
        wrap=lambda raw: context.wrap_socket(raw, server_hostname="127.0.0.1"))
    assert answer.startswith(b"HTTP/1.1 413 ") and answer.endswith(b'{"message": "MSG_TOO_BIG"}')
    assert took < PROMPT and server.proc.poll() is None
