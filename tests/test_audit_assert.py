"""``moe.audit.assert_causal`` in a project's own tests: silent (it returns the report) for a
causal block, an ``AssertionError`` carrying the report's summary and table otherwise.

Shapes: B=4, T=16, D=32, E=4 (the MoELayer's own shapes).
"""

from __future__ import annotations

import pytest
import torch
from test_audit import _one_thread  # noqa: F401  (autouse: one torch thread for the many tiny forwards)
from torch import nn

from moe import MoELayer
from moe.audit import AuditUsageError, CausalityError, assert_causal

B, T, D, E = 4, 16, 32, 4


def example() -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(0))


def layer(**options) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(D, 2 * D, E, **options)


def test_a_causal_layer_passes_and_returns_its_report():
    report = assert_causal(layer(router="topk", top_k=2), example(), batch_invariant=True, decode_consistent=True)
    assert report.verdict == "claims hold" and not report.leaks, report.table()


def test_a_leaky_layer_raises_with_the_table():
    with pytest.raises(CausalityError) as raised:
        assert_causal(layer(router="capacity", priority="score", capacity_factor=1.0), example(), quick=True)
    message = str(raised.value)
    assert isinstance(raised.value, AssertionError) and message.startswith("MoELayer: leaks in eval mode"), message
    assert "found by random_future (eval)" in message and "probe " in message and "max |delta|" in message, message
    assert raised.value.report.leaks_in == ["eval"]


def test_batch_invariance_and_decode_consistency_are_asserted_when_asked():
    batch_pooled = layer(router="capacity", priority="position", group="batch", capacity_factor=1.0)
    assert_causal(batch_pooled, example(), modes=("eval",))  # causal: passes
    with pytest.raises(CausalityError, match="not batch-invariant"):
        assert_causal(batch_pooled, example(), modes=("eval",), batch_invariant=True)
    sized_from_t = layer(router="capacity", priority="position", capacity_factor=1.0)
    with pytest.raises(CausalityError, match="prefix-only forwards differ in eval mode"):
        assert_causal(sized_from_t, example(), modes=("eval",), decode_consistent=True)


def test_a_target_that_cannot_run_raises():
    with pytest.raises(CausalityError, match="NOT AUDITED: the target failed on the example"):
        assert_causal(nn.Linear(3, 3), example(), modes=("eval",))


def test_a_float_example_without_its_time_axis_is_a_shape_problem_not_a_leak():
    """[N, D] features (the time axis missing) read as [B, T] would make features positions: on
    7dc4c10 a position-wise layer was reported as leaking."""
    with pytest.raises(AuditUsageError, match=r"float of shape \(4, 32\): float features must be \[B, T, D, \.\.\.\]"):
        assert_causal(nn.Linear(32, 32), torch.randn(4, 32))


def test_assert_causal_hides_its_own_frame_from_pytest():
    """A failing test shows the report first: pytest drops assert_causal's frame from the
    traceback it prints (``__tracebackhide__``)."""
    from _pytest._code import ExceptionInfo

    torch.manual_seed(0)
    leaky = MoELayer(D, 2 * D, E, router="capacity", priority="score", capacity_factor=1.0)
    with pytest.raises(CausalityError) as caught:
        assert_causal(leaky, example(), quick=True)
    info = ExceptionInfo.from_exception(caught.value)
    shown = [entry.path for entry in info.traceback.filter(info)]
    assert shown and not any(str(p).endswith("assertion.py") for p in shown), shown
