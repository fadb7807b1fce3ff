"""``moe-audit``'s input specs and the target's state comparison at their edges: sizes of zero,
token ids covering the whole vocabulary, special ids with stray commas, the coarsest dtype of
several outputs (largest eps, from torch.finfo), and hidden state holding a NaN number or a
tensor that changes dtype.
"""

import pytest
import torch
from torch import nn

from moe.audit import cli
from moe.audit.target import AuditUsageError, TargetState, coarsest


@pytest.mark.parametrize("spec", ["float:0,16,8", "float:2,16,0", "tokens:2,16,0", "tokens:0,4,8"])
def test_a_size_of_zero_is_refused(spec):
    with pytest.raises(AuditUsageError, match="sizes must be positive"):
        cli.parse_input(spec)


def test_token_inputs_draw_every_id_below_v():
    ids, v = cli.parse_input("tokens:64,64,3")
    assert v == 3 and ids.dtype == torch.long and ids.shape == (64, 64)
    assert sorted(ids.unique().tolist()) == [0, 1, 2]


def test_float_inputs_take_any_trailing_feature_dims():
    x, v = cli.parse_input("float:2,3,4,5", seed=1)
    assert v is None and x.shape == (2, 3, 4, 5)
    assert torch.equal(x, torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(1)))


def test_special_ids_ignore_empty_entries():
    assert cli._parse_ids("0, 5,") == (0, 5)
    assert cli._parse_ids("") == () and cli._parse_ids(None) == ()
    with pytest.raises(AuditUsageError, match="comma-separated integers"):
        cli._parse_ids("0,x")


def test_the_coarsest_dtype_has_the_largest_eps():
    assert torch.finfo(torch.bfloat16).eps > torch.finfo(torch.float16).eps > torch.finfo(torch.float32).eps
    assert coarsest([torch.float32, torch.bfloat16, torch.float16]) == torch.bfloat16
    assert coarsest([torch.float64, torch.float32]) == torch.float32
    assert coarsest([]) is None


class Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = float("nan")
        self.table = torch.tensor([1.0, float("nan")])  # NaN equals NaN in a tensor too
        self.history = [1, 2.5]


def test_unchanged_hidden_state_holding_nan_is_unchanged():
    state = TargetState(Stateful())
    assert TargetState.changed(state.hidden_state(), state.hidden_state()) == []


def test_hidden_state_that_changes_dtype_or_value_has_changed():
    module = Stateful()
    state = TargetState(module)
    before = state.hidden_state()
    module.table = module.table.double()  # same values, another dtype
    module.history.append(3)
    assert TargetState.changed(before, state.hidden_state()) == ["history", "table"]
    before = state.hidden_state()
    module.table[1] = 2.0  # a NaN replaced
    assert TargetState.changed(before, state.hidden_state()) == ["table"]
