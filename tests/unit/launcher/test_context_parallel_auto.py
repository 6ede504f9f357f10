"""strategy=auto with a cp_degree (launcher/auto.py): refused with its fix, not "no legal layout"."""

from __future__ import annotations


def test_the_layout_search_refuses_cp_instead_of_finding_nothing():
    from fleetwise.launcher.auto import resolve_auto

    out = resolve_auto(
        ["recipe=gpt/tiny", "strategy=auto", "strategy.cp_degree=2", "hardware.devices_per_node=4"],
        progress=False,
    )
    (p,) = out.problems
    assert p.loc == "strategy.cp_degree" and "strategy=hybrid strategy.cp_degree=2" in p.hint
