"""Two pieces of the audit's text worked out by hand on reports built directly: the summary
table's decode cell, which reads the modes the decode claim covers (the causal ones, or every
mode where none is), and the evidence line's token ids, listed up to six per reason and
counted beyond."""

from __future__ import annotations

import re

from moe.audit.report import AuditReport, ProbeResult, summary_table
from moe.routing import Claims


def decode_probe(mode: str, leaks: bool) -> ProbeResult:
    return ProbeResult(
        "decode",
        mode,
        leaks,
        0.5 if leaks else 0.0,
        3 if leaks else None,
        0.2 if leaks else 0.0,
        kind="decode",
        comparisons=8,  # it ran: a probe that compared nothing tests nothing ("untested")
    )


def decode_cell(claims: Claims) -> str:
    report = AuditReport(
        "t", ("train", "eval"), claims, probes=[decode_probe("train", True), decode_probe("eval", False)]
    )
    head, _, row = summary_table([report]).splitlines()
    return dict(zip(re.split(r"\s{2,}", head), re.split(r"\s{2,}", row)))["decode"]


def test_the_decode_cell_reads_the_modes_its_claim_covers():
    # causal in eval only: the decode claim covers eval, where prefixes reproduced the outputs
    assert decode_cell(Claims(False, True, True, True)) == "yes/same (eval)"
    # causal in neither mode: the claim covers both, and training's prefixes differ
    assert decode_cell(Claims(False, False, True, True)) == "yes/differs"
    assert decode_cell(Claims(True, True, True, False)) == "no/differs"


def test_a_decode_probe_that_compared_nothing_is_untested_in_the_cell():
    report = AuditReport("t", ("eval",), Claims(True, True, True, True), probes=[decode_probe("eval", False)])
    report.probes[0].comparisons = 0
    head, _, row = summary_table([report]).splitlines()
    assert dict(zip(re.split(r"\s{2,}", head), re.split(r"\s{2,}", row)))["decode"] == "yes/untested"


def test_token_ids_are_listed_up_to_six_per_reason():
    six = AuditReport("t", ("eval",), None, ids_tried={"smallest": [0], "the example's own": [1, 2, 3, 4, 5, 6]})
    assert "token ids put in futures: 0 (smallest); 1, 2, 3, 4, 5, 6 (the example's own); and uniform random ids" in (
        six.summary()
    )
    seven = AuditReport("t", ("eval",), None, ids_tried={"the example's own": [1, 2, 3, 4, 5, 6, 7]})
    assert "token ids put in futures: 7 ids (the example's own: 1, 2, 3, 4, ...); and uniform random ids" in (
        seven.summary()
    )
