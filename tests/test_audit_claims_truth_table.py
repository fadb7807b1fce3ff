"""moe.audit.report.AuditReport's judgement of claims over the whole truth table: every
combination of the four claims against every combination of what the probes saw (a future leak in
train / eval mode; a batch probe absent, clean or leaking; a decode probe absent, clean or
differing), counted against a reference written out here from the rules in words:

* a violation: claiming causal in a mode that leaks; claiming batch invariance where the batch
  probe saw interference; claiming decode consistency where a prefix-only forward differed in a
  mode claimed causal;
* unshown: claiming a leak in a mode where none was found; claiming batch interference or decode
  inconsistency where that probe ran and saw none (a probe that did not run shows nothing)."""

import itertools

from moe.audit.report import AuditReport, ProbeResult
from moe.routing import Claims

MODES = ("train", "eval")


def probe(kind: str, mode: str, leaks: bool, ran: bool = True) -> ProbeResult:
    return ProbeResult(
        name=f"{kind}_probe",
        mode=mode,
        leaks=leaks,
        max_abs_delta=1.0 if leaks else 0.0,
        first_leaking_position=0 if leaks else None,
        fraction_affected=0.5 if leaks else 0.0,
        kind=kind,
        comparisons=1 if ran else 0,
    )


def expected(claims: Claims, future: dict, batch: str, decode: str) -> tuple[int, int]:
    """(violations, unshown) by the rules of the module docstring."""
    causal = {"train": claims.causal_train, "eval": claims.causal_eval}
    violations = sum(1 for m in MODES if future[m] and causal[m])
    unshown = sum(1 for m in MODES if not future[m] and not causal[m])
    if batch == "leak" and claims.batch_invariant:
        violations += 1
    if batch == "clean" and not claims.batch_invariant:
        unshown += 1
    if decode == "leak" and claims.decode_consistent and causal["eval"]:
        violations += 1
    if decode == "clean" and not claims.decode_consistent:
        unshown += 1
    return violations, unshown


def test_violations_and_unshown_claims_over_the_truth_table():
    checked = 0
    for flags in itertools.product([False, True], repeat=4):
        claims = Claims(*flags)
        for leak_train, leak_eval in itertools.product([False, True], repeat=2):
            for batch, decode in itertools.product(["absent", "clean", "leak"], repeat=2):
                future = {"train": leak_train, "eval": leak_eval}
                probes = [probe("future", m, future[m]) for m in MODES]
                if batch != "absent":
                    probes.append(probe("batch", "eval", batch == "leak"))
                if decode != "absent":
                    probes.append(probe("decode", "eval", decode == "leak"))
                report = AuditReport(name="t", modes=MODES, claims=claims, probes=probes)
                want = expected(claims, future, batch, decode)
                case = (flags, future, batch, decode)
                assert (len(report.violations), len(report.unshown)) == want, case
                assert report.claims_hold == (want == (0, 0)), case
                assert report.verdict == ("claims hold" if want == (0, 0) else "FALSE CLAIM"), case
                checked += 1
    assert checked == 16 * 4 * 9


def test_a_probe_that_did_not_run_shows_no_absence_of_interference():
    claims = Claims(causal_train=True, causal_eval=True, batch_invariant=False, decode_consistent=False)
    probes = [probe("future", m, False) for m in MODES]
    probes += [probe("batch", "eval", False, ran=False), probe("decode", "eval", False, ran=False)]
    report = AuditReport(name="t", modes=MODES, claims=claims, probes=probes)
    assert report.unshown == [] and report.verdict == "claims hold"


def test_without_claims_the_verdict_reads_the_leaks_alone():
    for leak_train, leak_eval, batch in itertools.product([False, True], repeat=3):
        probes = [
            probe("future", "train", leak_train),
            probe("future", "eval", leak_eval),
            probe("batch", "eval", batch),
        ]
        report = AuditReport(name="t", modes=MODES, claims=None, probes=probes)
        assert report.false_claims == []
        assert report.verdict == ("LEAKS" if leak_train or leak_eval else "clean")
