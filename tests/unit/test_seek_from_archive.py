"""A seek --from-archive (issue 46), without a database: the seek's steps driven by hand, what
every admin surface says of the gap, the CLI's flag, and the pipeline's ``reinject`` range and
arguments."""

from __future__ import annotations

import argparse
import shlex
from datetime import datetime, timezone

import pytest

from dmq_pipeline import cli as pipeline_cli
from dmq_pipeline import reinject
from dmq_pipeline.errors import UsageError
from dmq_pipeline.options import ReinjectSettings, from_args
from dmq_server.admin import cli as admin_cli
from dmq_server.admin.seek_request import describe_seek, parse_flag, reinject_command, report, summary
from dmq_server.core.errors import Invalid
from dmq_server.db.seek import (
    ArchiveGap, BeforeRetainedStart, NotArchived, SeekRefused, Sought, ToId, ToTime, seek_channel_steps,
)

NOW_MS = 1_800_000_000_000
SWEPT_MS = NOW_MS - 3_600_000  # the retention sweep removed everything published up to an hour ago
SWEPT_ID = 500


def drive(target, *, from_archive=True, archive="/srv/dmq-archive", dry_run=False):
    """Run seek_channel_steps against answers a database would give: the channel registered,
    no time to live, what the sweep removed, the oldest kept id 501; no row for the search."""
    steps = seek_channel_steps("orders", "billing", target, dry_run, from_archive=from_archive)
    statements = []
    answers = {
        "seek_lock": [(None,)],
        "seek_state": [(True, None, SWEPT_ID, SWEPT_MS, NOW_MS, 501, SWEPT_MS + 10, archive)],
        "seek_ends": [(None, None)],
        "seek_channel": [(3, 503, 501, SWEPT_MS + 10, None if dry_run else 2, None, None)],
    }
    try:
        statement = next(steps)
        while True:
            statements.append((statement.name, statement.params))
            statement = steps.send(answers[statement.name])
    except StopIteration as done:
        return done.value, statements


def test_a_time_before_the_retained_start_seeks_to_it_and_names_the_gap():
    sought, statements = drive(ToTime(SWEPT_MS - 86_400_000))
    assert sought.target == ToTime(SWEPT_MS + 1)  # the first time nothing was removed at
    assert sought.gap == ArchiveGap(SWEPT_MS - 86_400_000, SWEPT_MS + 1, "/srv/dmq-archive")
    [seek] = [params for name, params in statements if name == "seek_channel"]
    assert seek["before_ms"] == SWEPT_MS + 1


def test_a_time_at_the_swept_time_itself_is_in_the_gap():
    sought, _ = drive(ToTime(SWEPT_MS))
    assert sought.gap is not None and sought.gap.since_ms == SWEPT_MS


def test_a_time_the_store_holds_has_no_gap():
    sought, _ = drive(ToTime(SWEPT_MS + 5))
    assert sought.target == ToTime(SWEPT_MS + 5) and sought.gap is None


def test_without_the_flag_it_is_refused_naming_the_flag():
    with pytest.raises(BeforeRetainedStart, match="--from-archive"):
        drive(ToTime(SWEPT_MS - 1), from_archive=False)


def test_a_database_never_archived_refuses_it():
    with pytest.raises(NotArchived, match="no archive to re-inject it from"):
        drive(ToTime(SWEPT_MS - 1), archive=None)


def test_an_id_before_the_retained_start_is_refused_asking_for_a_time():
    with pytest.raises(SeekRefused, match="takes a time"):
        drive(ToId(SWEPT_ID))


GAP = ArchiveGap(1_700_000_000_000, 1_700_000_360_001, "/srv/dmq archive")


def sought(gap=GAP, epoch=4):
    return Sought(ToTime(GAP.until_ms), 3, 503, 501, GAP.until_ms + 9, epoch, None, None, gap)


def test_the_reinject_command_is_quoted_and_names_the_gap_to_the_millisecond():
    words = shlex.split(reinject_command("orders", "bill ing", GAP))
    assert words == ["dmq-pipeline", "reinject", "--archive", "/srv/dmq archive", "--topic", "orders",
                     "--channel", "bill ing", "--since", "2023-11-14T22:13:20.000Z",
                     "--until", "2023-11-14T22:19:20.001Z"]


def test_the_json_report_carries_the_gap_only_when_there_is_one():
    answer = report("main", sought(), False, "orders", "billing")
    assert answer["from_archive"] == {"since_ms": GAP.since_ms, "until_ms": GAP.until_ms, "archive": GAP.location,
                                      "reinject": reinject_command("orders", "billing", GAP)}
    assert "gap" not in answer and answer["epoch"] == 4
    assert "from_archive" not in report("main", sought(gap=None), False, "orders", "billing")


@pytest.mark.parametrize("dry_run", [False, True])
def test_the_summary_says_both_parts(dry_run):
    text = summary("orders", "billing", "main", sought(epoch=None if dry_run else 4), dry_run)
    assert "(the retained start" in text and "2023-11-14T22:19:20.001Z" in text
    assert text.splitlines()[-1].strip() == reinject_command("orders", "billing", GAP)
    assert ("would deliver" in text) is dry_run


def test_the_audit_entry_says_where_it_was_sought_instead():
    asked = ToTime(GAP.since_ms)
    assert describe_seek("orders", "billing", asked, [sought()]) == (
        "orders/billing to time 2023-11-14T22:13:20.000Z, from archive: sought to time "
        "2023-11-14T22:19:20.001Z, gap left to dmq-pipeline reinject")
    assert describe_seek("orders", "billing", asked, [sought(gap=None)]) == "orders/billing to time 2023-11-14T22:13:20.000Z"


@pytest.mark.parametrize("value, flag", [(None, False), ("true", True), ("1", True), ("false", False), ("no", False)])
def test_the_admin_apis_flag(value, flag):
    assert parse_flag("from_archive", value) is flag


def test_the_admin_apis_flag_refuses_other_words():
    with pytest.raises(Invalid, match="from_archive: expected true or false"):
        parse_flag("from_archive", "maybe")


def test_the_cli_takes_from_archive():
    args = admin_cli.build_parser().parse_args(["channel", "seek", "orders", "billing", "--by=-7d", "--from-archive"])
    assert args.from_archive is True and args.by == "-7d"
    plain = admin_cli.build_parser().parse_args(["channel", "seek", "orders", "billing", "--to-latest"])
    assert plain.from_archive is False


# -- dmq-pipeline reinject ---------------------------------------------------------------


def reinject_args(*extra: str) -> argparse.Namespace:
    return pipeline_cli.build_parser().parse_args(["reinject", *extra])


def test_reinject_reads_its_arguments():
    args = reinject_args("--archive", "/a", "--topic", "orders", "--channel", "billing", "--since", "2d",
                         "--batch", "50", "--dry-run", "--json")
    settings = from_args(ReinjectSettings, args).validate()
    assert (settings.archive, settings.topic, settings.channel, settings.since, settings.until) == (
        "/a", "orders", "billing", "2d", "")
    assert settings.batch == 50 and settings.dry_run and args.json and args.func is pipeline_cli.cmd_reinject


@pytest.mark.parametrize("missing", ["--archive", "--topic", "--channel", "--since"])
def test_reinject_needs_archive_topic_channel_and_since(missing):
    given = {"--archive": "/a", "--topic": "orders", "--channel": "billing", "--since": "2d"}
    del given[missing]
    with pytest.raises(UsageError, match=f"reinject needs {missing}"):
        from_args(ReinjectSettings, reinject_args(*[w for pair in given.items() for w in pair])).validate()


def test_reinject_refuses_a_batch_below_one():
    with pytest.raises(UsageError, match="--batch 0"):
        ReinjectSettings(archive="/a", topic="t", channel="c", since="1d", batch=0).validate()


class RetainedStart:
    """The driver's database as ``reinject.gap`` reads it: dmq_retention's row, or none."""

    def __init__(self, row):
        self.row, self.asked = row, []

    def one(self, name, **params):
        self.asked.append((name, params))
        return self.row


NOW = datetime(2027, 1, 15, 12, tzinfo=timezone.utc)


def test_the_range_ends_by_default_where_the_seek_sought_to():
    db = RetainedStart((SWEPT_ID, 1_800_000_000_000))
    span = reinject.gap(db, ReinjectSettings(topic="orders", since="2027-01-01"), NOW)
    assert span.until == datetime(2027, 1, 15, 8, 0, 0, 1000, tzinfo=timezone.utc)  # swept_ms + 1 ms
    assert span.since == datetime(2027, 1, 1, tzinfo=timezone.utc)
    assert db.asked == [("retained_start", {"topic": "orders"})]


def test_an_explicit_until_is_taken_as_given():
    span = reinject.gap(RetainedStart(None), ReinjectSettings(topic="orders", since="2027-01-01",
                                                              until="2027-01-02T00:00:00.5Z"), NOW)
    assert span.until == datetime(2027, 1, 2, 0, 0, 0, 500000, tzinfo=timezone.utc)


def test_a_topic_nothing_was_swept_of_has_no_gap():
    with pytest.raises(UsageError, match="removed nothing of topic orders"):
        reinject.gap(RetainedStart(None), ReinjectSettings(topic="orders", since="1d"), NOW)


def test_a_range_starting_at_or_after_the_retained_start_is_empty():
    with pytest.raises(UsageError, match="is not before the retained start"):
        reinject.gap(RetainedStart((SWEPT_ID, 1_800_000_000_000)), ReinjectSettings(topic="orders", since="1h"), NOW)


def test_each_channel_has_its_own_producer():
    assert reinject.producer_for("billing") == "dmq-archive:billing" != reinject.producer_for("shipping")
    assert reinject.producer_for("x").startswith(reinject.PRODUCER_PREFIX)
