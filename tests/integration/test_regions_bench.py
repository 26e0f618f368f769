"""``rlbus bench regions --quick`` in CI: the loop across an emulated WAN (three regions, rack-aware brokers,
a relay per region, Toxiproxy links, one region cut off for 20 s), then the exactly-once audit.

Starts its own three-broker cluster, Redis and toxiproxy-server on free loopback ports (about three minutes on
two cores); fails, never skips, when any of them cannot start.
"""

from __future__ import annotations

import pytest

from rlbus_tools.bench import regions


@pytest.mark.slow
def test_the_loop_across_a_wan_loses_nothing_and_relays_save_crossings() -> None:
    result = regions.run(quick=True)
    s = result["summary"]
    relay, direct = result["runs"]["relay"], result["runs"]["direct"]
    notes = [relay["report"]["notes"], direct["report"]["notes"]]
    assert s["passed"], (relay["report"]["checks"], direct["report"]["checks"], notes)
    assert s["lost"] == 0 and s["trained_twice"] == 0
    # every region synced in the WAN phase; ap-south is 90 ms from the origin, so a sync there takes at least
    # the relay's round trip to it (the links are really in the path)
    assert all(s["sync_lag_p99_s_by_region"][r] is not None for r in regions.REGIONS)
    wan = next(p for p in relay["phases"] if p["phase"] == "wan")["regions"]
    assert wan["ap-south"]["sync_lag_p50_s"] >= 0.18, wan
    # two workers per remote region: through a relay each chunk crosses once, without one twice
    assert 0 < s["interregion_bytes_per_version_relay"] < 0.75 * s["interregion_bytes_per_version_no_relay"], s
    assert s["cut_recovery_s"] is not None and s["cut_recovery_s"] < 120
    cut = next(p for p in relay["phases"] if p["phase"] == "cut")["regions"]["ap-south"]
    # nothing crosses a cut link (a response already on its way when the cut came may still count)
    assert cut["wan_bytes_per_version"] <= 0.2 * wan["ap-south"]["wan_bytes_per_version"], (cut, wan)
    assert all(r["abandoned"] == 0 for r in relay["relay_upstream"].values())
    # us-east's relay stopped for a phase: its workers read from the origin (counted) and kept swapping
    assert s["relay_down_syncs"] > 0 and s["relay_down_failovers"] > 0, relay["relay_down"]
