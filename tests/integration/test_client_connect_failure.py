"""A BlockingClient whose connection fails after connect (during the magic, the TLS
handshake or AUTH) closes its socket before it raises: the caller never got a client to
close, and a leak there was found by the chaos suite only by chance (net-clients-reset)."""

from __future__ import annotations

import gc
import socket
import threading
import warnings

import pytest

from dmq_client.blocking import BlockingClient, ClientError

pytestmark = pytest.mark.integration


def test_a_connection_closed_during_auth_leaves_no_socket_open():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve_once() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(64)  # the magic and UP_AUTH, then close without an answer

    server = threading.Thread(target=serve_once, daemon=True)
    server.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            with pytest.raises((ClientError, OSError)):
                BlockingClient("127.0.0.1", port, timeout=5, auth_secret="s3cret")
            gc.collect()  # an unclosed socket warns when it is collected
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    finally:
        server.join(5)
        listener.close()
