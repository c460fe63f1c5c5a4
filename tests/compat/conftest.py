"""Compatibility tests: real third-party NSQ clients (pynsq, gnsq) against a real dmq-server.

They reuse the integration fixtures: ``make_server(**flags)`` runs a dmq-server
subprocess on a fresh database; ``topic`` registers the reliable topic ``orders``
with channel ``billing``.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import certs, make_server, topic  # noqa: F401  (fixtures)


@pytest.fixture
def nsq_server(make_server, tmp_path):  # noqa: F811
    """A dmq-server with its own data path (fast-store files under ``data/nsq``)."""
    return make_server(data_path=str(tmp_path / "data"))
