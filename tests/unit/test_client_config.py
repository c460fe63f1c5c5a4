"""MqConfig validation, the docs' configuration reference, and the import boundary."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dmq_client import MqConfig

REPO = Path(__file__).resolve().parents[2]


def test_defaults_are_dmqs():
    """3 resends 30 s apart, checked every second, 64 KiB bodies."""
    config = MqConfig()
    assert (config.resend_tries, config.resend_interval, config.resend_check_interval) == (3, 30.0, 1.0)
    assert config.max_body_size == 64 * 1024
    assert config.addresses == [("127.0.0.1", 4150)]


def test_servers_accept_a_comma_separated_string():
    """``servers`` may be one comma-separated string, as from an environment variable."""
    config = MqConfig(servers="10.0.0.1:4150, 10.0.0.2:4150")
    assert config.addresses == [("10.0.0.1", 4150), ("10.0.0.2", 4150)]


@pytest.mark.parametrize(
    "field, value",
    [
        ("servers", ()),
        ("servers", ("nohost",)),
        ("servers", ("h:99999",)),
        ("producer_id", "x" * 65),
        ("producer_id", "prodüzent"),
        ("send_queue_size", 0),
        ("resend_tries", -1),
        ("resend_interval", 0),
        ("route_wait", -1),
        ("handler_threads", 0),
    ],
)
def test_bad_values_fail_at_construction_naming_the_field(field, value):
    """A bad value raises ValueError at construction, and the message names the field."""
    with pytest.raises(ValueError, match=field):
        MqConfig(**{field: value})


def test_docs_reference_lists_every_setting_with_its_default():
    """docs/client.md's configuration table names every field and its default, so the
    docs cannot drift from the code."""
    text = (REPO / "docs" / "client.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", text, flags=re.M))
    for name, default, _help in MqConfig.reference():
        assert name in rows, f"{name} missing from docs/client.md"
        if isinstance(default, tuple):
            shown = ",".join(default)
        else:
            shown = repr(default) if isinstance(default, str) else str(default)
        assert rows[name] == shown, f"{name}: docs say {rows[name]!r}, code says {shown!r}"
    assert set(rows) <= {f[0] for f in MqConfig.reference()}


def test_import_pulls_in_neither_twisted_nor_psycopg():
    """A service embeds the client without the server's dependencies (every public
    name loaded, not just the package)."""
    code = (
        "import sys, dmq_client\n"
        "loaded = [getattr(dmq_client, name) for name in dmq_client.__all__]\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('twisted', 'psycopg', 'psycopg2', 'kazoo'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
