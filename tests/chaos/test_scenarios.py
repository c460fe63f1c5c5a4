"""Every fault of the suite, under mixed load, counted: zero lost, zero duplicated.

The short form (CI): 2 s of load, the fault held 4 s (longer than the nodes' 3 s
ZooKeeper sessions), 2 s after it recovers; the
counts and recovery time of each scenario are printed in the "chaos reports" section.
``python bench/chaos.py`` runs the same scenarios for minutes (docs/benchmarks.md).
"""

from __future__ import annotations

import pytest

from . import conftest, scenarios

SHORT = scenarios.Timing(before=2.0, hold=4.0, after=2.0, drain=60.0, linger=1.5)

# Faults no producer may hear about: PostgreSQL stays writable throughout. A standby's
# death only makes commits wait for the other one (strict synchronous mode); a ZooKeeper
# restart leaves the primary in place thanks to Patroni's failsafe_mode (without it,
# Patroni demoted the primary and producers got 2-7 s of SEND_SERVER_ERROR).
NO_ERRORS = {"pg-standby-kill", "zk-restart"}


@pytest.mark.parametrize("name", list(scenarios.SCENARIOS))
def test_no_acknowledged_message_is_lost(chaos_cluster, name):
    """Under the fault, every send acknowledged to a producer reaches both channels,
    nothing is delivered again once its ack was durable, nothing unknown appears, and
    the cluster serves producers again by itself."""
    try:
        report = scenarios.run(chaos_cluster, name, SHORT)
        text = scenarios.format_report(report)
        conftest.REPORTS.append(text)
        if not report["ok"]:
            text += "\n" + scenarios.diagnose(chaos_cluster, report)
    except BaseException:
        print(chaos_cluster.logs())
        raise
    finally:
        chaos_cluster.restore()
    assert report["acked"] > 500, text  # the load ran: there was something to lose
    for channel in report["channels"]:
        assert channel["lost"] == 0, text
        assert channel["duplicated"] == 0, text
        assert channel["unexpected"] == 0, text
    assert report["all_delivered"] and not report["failures"], text
    # it recovered while the load was on (the outage ended before the producers stopped)
    assert report["acks_per_s"]["after"] > 0, text
    if name in NO_ERRORS:
        assert report["producer_errors"] == {}, text
    if name == "clock-jump":  # its delayed messages were not all left to the other nodes
        assert report["notes"]["delay_moved_by_jumped_node"] > 0, text
    if name == "node-pause-slow-taker":
        notes = report["notes"]
        # the race was set up: the frozen node woke with acks of copies the taker held
        # unpushed; the fence refused them, so none was durable before the taker pushed it
        assert notes["stale_acks_on_paused_node"] > 100, text
        assert notes["stale_acks_on_waking"]["fenced"] > 0, text
        assert notes["stale_acks_durable_before_taker_pushed"] == 0, text
    if name == "retention-sweep":
        notes = report["notes"]
        # audit's copies older than the retention were all in the store when it came back,
        # and went once audit had them; the nodes swept what both channels were done with
        assert notes["audit_old_held_at_heal"] > 100, text
        assert notes["audit_old_held_missing_at_heal"] == 0, text
        assert notes["audit_old_held_stored_at_end"] == 0, text
        assert notes["swept_by_nodes"] > notes["audit_old_held_at_heal"], text
