"""Every shell and Python snippet in README.md and docs/ runs as written, or says why not.

A fenced block in ``sh``, ``bash`` or ``python`` is run, in page order, against a fresh
dmq-server started as the README starts it (``--data-path ./dmq-data``, the default
ports), from a directory that looks like a checkout (``.venv`` is the repository's).
A block that must not run is marked on the line before its fence:

    <!-- not run: why -->                 placeholders, other hosts, the command itself
    <!-- run: until "TEXT" -->            runs for ever (a consumer): stopped once TEXT is printed

so the documentation cannot drift from the code without a test failing. docs/client.md
has its own, richer test (test_client_docs.py); docs/benchmarks.md records runs that take
minutes each.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from .support import REPO, http_get

pytestmark = pytest.mark.integration

PAGES = ["README.md", "docs/admin.md", "docs/nsq.md", "docs/observability.md", "docs/operations.md", "docs/pipeline.md", "docs/protocol.md"]
NOT_PAGES = {
    "docs/client.md": "test_client_docs.py runs its examples",
    "docs/architecture.md": "no snippets; tests/unit/test_architecture_doc.py checks its modules and layers",
    "docs/benchmarks.md": "benchmark runs take minutes",
}
FENCE = re.compile(
    r"(?:<!-- (?P<marker>not run: [^>]*?|run: until \"[^\"]+\") -->\n)?```(?P<lang>sh|bash|python)\n(?P<code>.*?)```",
    re.S,
)


@dataclass
class Snippet:
    page: str
    line: int
    lang: str
    code: str
    marker: str | None

    @property
    def skip_reason(self) -> str | None:
        if self.marker and self.marker.startswith("not run:"):
            return self.marker.removeprefix("not run:").strip()
        return None

    @property
    def until(self) -> str | None:
        if self.marker and self.marker.startswith("run: until"):
            return self.marker.split('"')[1]
        return None


def snippets(page: str) -> list[Snippet]:
    text = (REPO / page).read_text()
    return [
        Snippet(page, text.count("\n", 0, m.start("code")), m["lang"], m["code"], m["marker"])
        for m in FENCE.finditer(text)
    ]


def test_every_page_is_checked_or_excused():
    """A new page with snippets is added to PAGES (or NOT_PAGES with a reason)."""
    pages = {str(p.relative_to(REPO)) for p in [REPO / "README.md", *(REPO / "docs").glob("*.md")]}
    assert pages == set(PAGES) | set(NOT_PAGES)
    for page in PAGES:
        for s in snippets(page):
            assert s.skip_reason != "", f"{page}:{s.line}: a 'not run' marker needs its reason"


class Checkout:
    """A directory like a fresh checkout after setup, with dmq-server running in it."""

    def __init__(self, root: Path):
        self.root = root
        (root / ".venv").symlink_to(REPO / ".venv")
        (root / "deploy").symlink_to(REPO / "deploy")
        self.env = dict(os.environ, PATH=f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}")
        self.env.pop("DMQ_DATA_PATH", None)
        log = open(root / "dmq-server.log", "wb")
        self.server = subprocess.Popen(
            [str(REPO / ".venv" / "bin" / "dmq-server"), "--data-path", "./dmq-data"],
            cwd=root, env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + 90
        while True:
            assert self.server.poll() is None, self.log()
            try:
                if http_get("http://127.0.0.1:4151/ping", timeout=1)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"dmq-server not ready:\n{self.log()}"
            time.sleep(0.1)

    def log(self) -> str:
        return (self.root / "dmq-server.log").read_text(errors="replace")[-3000:]

    def run(self, snippet: Snippet) -> None:
        if snippet.lang == "python":
            args = [str(REPO / ".venv" / "bin" / "python"), "-c", snippet.code]
        else:
            args = ["bash", "-e", "-o", "pipefail", "-c", snippet.code]
        where = f"{snippet.page}:{snippet.line}"
        if snippet.until is None:
            done = subprocess.run(args, cwd=self.root, env=self.env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, f"{where} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
            return
        with subprocess.Popen(
            args, cwd=self.root, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        ) as proc:  # leaving the block closes the pipe
            printed = bytearray()
            def read() -> None:
                for chunk in iter(lambda: proc.stdout.read1(4096), b""):
                    printed.extend(chunk)

            reader = threading.Thread(target=read)
            reader.start()
            try:
                deadline = time.monotonic() + 60
                while snippet.until.encode() not in printed:
                    assert proc.poll() is None or reader.is_alive(), f"{where} ended:\n{printed.decode()}"
                    assert time.monotonic() < deadline, f"{where} did not print {snippet.until!r}:\n{printed.decode()}"
                    time.sleep(0.05)  # polling the output buffer a thread fills
            finally:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                reader.join(10)

    def stop(self) -> None:
        self.server.send_signal(signal.SIGTERM)
        try:
            self.server.wait(60)
        except subprocess.TimeoutExpired:
            self.server.kill()


@pytest.fixture
def checkout_dir(scratch_dir: Path) -> Path:
    """Not pytest's tmp_path: the embedded PostgreSQL runs as an unprivileged user when
    the tests run as root, and must be able to enter the data directory."""
    return scratch_dir


@pytest.mark.parametrize("page", [p for p in PAGES if any(s.skip_reason is None for s in snippets(p))])
def test_the_snippets_of_a_page_run(page, checkout_dir):
    runnable = [s for s in snippets(page) if s.skip_reason is None]
    checkout = Checkout(checkout_dir)
    try:
        for snippet in runnable:
            checkout.run(snippet)
    finally:
        checkout.stop()


def test_the_readme_banner_is_the_one_the_server_prints(checkout_dir):
    """The README's sample of the ready banner has the lines the server prints, in order."""
    text = (REPO / "README.md").read_text()
    sample = text[text.index("```\ndmq is ready\n") + 4 :]
    sample = sample[: sample.index("```")]
    checkout = Checkout(checkout_dir)
    try:
        printed = checkout.log()
    finally:
        checkout.stop()
    printed = printed[printed.index("dmq is ready") :]

    def labels(banner: str) -> list[str]:
        return [line[:15].strip() for line in banner.splitlines() if line.startswith("  ")]

    assert labels(sample) == labels(printed)
