"""The built-in audit suite's target names: one per (kind, router, option set), so that no two
rows of a report read alike; the option that tells two expert-threshold targets apart (the
population statistic) is in the name."""

from __future__ import annotations

from moe.audit.suite import ROUTER_CONFIGS, builtin_targets, config_label


def test_every_builtin_target_has_its_own_name():
    names = [t.name for t in builtin_targets()]
    assert len(names) == 3 * len(ROUTER_CONFIGS)
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)


def test_the_population_statistic_is_named():
    assert config_label("ec_threshold", {"statistic": "population", "score": "sigmoid"}) == "ec_threshold(population)"
    assert config_label("ec_threshold", {"capacity_factor": 1.0}) == "ec_threshold"
