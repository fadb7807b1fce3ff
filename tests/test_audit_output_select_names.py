"""moe.audit.target.read_outputs's ``select`` (``--output``): a name keeps the field of that
path and every field under it (``name.``), never a sibling that merely begins with the same
letters; a name that matches no path is an error. Expected fields listed by hand."""

import pytest
import torch

from moe.audit.target import OutputError, read_outputs

B, T = 2, 3


def output() -> dict:
    def x():
        return torch.zeros(B, T, 4)

    return {"logits": x(), "logits_scaled": x(), "aux": {"logits": x(), "hidden": x()}, "auxiliary": x()}


@pytest.mark.parametrize(
    "select, kept",
    [
        ("logits", ["logits"]),
        ("logits_scaled", ["logits_scaled"]),
        ("aux", ["aux.logits", "aux.hidden"]),
        ("aux.hidden", ["aux.hidden"]),
        ("auxiliary, logits", ["logits", "auxiliary"]),
    ],
)
def test_a_selected_name_keeps_its_path_and_what_is_under_it(select, kept):
    fields, skipped = read_outputs(output(), B, T, select)
    assert [f.name for f in fields] == kept
    everything = ["logits", "logits_scaled", "aux.logits", "aux.hidden", "auxiliary"]
    assert sorted(s.name for s in skipped) == sorted(n for n in everything if n not in kept)


@pytest.mark.parametrize("select", ["log", "aux.hid", "logits.x"])
def test_a_name_that_only_begins_a_field_name_is_not_a_field(select):
    with pytest.raises(OutputError, match="has no field"):
        read_outputs(output(), B, T, select)
