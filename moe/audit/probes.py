"""The built-in probes, registered in this order (:mod:`moe.audit.registry`).

Shape legend: B batch, T sequence, F output features per position.

1. ``random_future`` (future): resample positions > t, for every cut t (0 and T-2 included,
   up to 16 cuts).
2. ``adversarial_future`` (future): futures built to overflow the experts earlier tokens use,
   or to leave them (:mod:`moe.audit.floods`). Random perturbations rarely move a token across
   a top-k or capacity cut-off: this probe covers that blind spot.
3. ``jacobian`` (future, measured): |d output[s] / d input[> s]| for every probed s (continuous
   leaks, e.g. statistics over the sequence; blind to discrete ones). Not run (and the report
   says why) for an integer output, a target with no gradient path, or, in eval mode, a target
   that computes other outputs with gradients enabled.
4. ``batch_interference`` (batch): change the other samples and watch one, change one and
   watch every other, run one alone. Reported as ``batch_invariant``, not as a future leak.
5. ``decode_consistency`` (decode): the output at positions <= t from the prefix 0..t alone
   against the full-sequence output, for every prefix length the target accepts (the others
   are reported as skipped).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from moe.audit.calibration import difference
from moe.audit.comparator import Variant
from moe.audit.context import ProbeContext
from moe.audit.floods import adversarial_future, batch_interference
from moe.audit.registry import Probe, register_probe
from moe.audit.report import BATCH_PROBE, DECODE_PROBE, ProbeResult
from moe.audit.runner import TargetFailure
from moe.audit.target import Outputs


def random_future(ctx: ProbeContext) -> Iterator[Variant]:
    gen = ctx.gen(1)
    rest = tuple(ctx.x.shape[2:])
    for _ in range(ctx.trials):
        for c in ctx.cuts:
            yield ctx.with_future(c, ctx.sampler.draw((ctx.b, ctx.t - c - 1, *rest), gen), f"positions > {c} resampled")


def jacobian(ctx: ProbeContext) -> ProbeResult:
    """A result that did not run (``skipped`` says why) for a target that is not differentiable,
    fails under autograd, or, in eval mode, computes other outputs with gradients enabled than its
    eval forward does (its eval path then has no gradient to read)."""
    try:
        res = ctx.runner.forward_with_grad(ctx.x)
    except TargetFailure as e:
        return _jacobian_skipped(ctx, f"the target fails with gradients enabled ({e})")
    if res is None:
        return _jacobian_skipped(ctx, _why_no_gradient(ctx))
    value_BTF, wrt = res
    if ctx.mode == "eval" and _takes_another_path(ctx, value_BTF):
        return _jacobian_skipped(
            ctx,
            "with gradients enabled the target computes other outputs than its eval forward (it picks its path by "
            "torch.is_grad_enabled() or x.requires_grad), so the eval path has no gradient to read",
        )
    gen = ctx.gen(5)
    future, own = [], []
    for s in ctx.cuts:
        # Random signs: sum_f w_f d out[s, f] / d in[r] cannot cancel for every draw, and equals
        # the Jacobian entry itself where each input feature moves a single output feature.
        w = torch.randint(0, 2, value_BTF[:, s].shape, generator=gen).to(value_BTF) * 2 - 1
        row = (value_BTF[:, s] * w).nan_to_num(0.0, 0.0, 0.0).sum()  # a NaN output has no gradient to read
        try:
            (g,) = torch.autograd.grad(row, wrt, retain_graph=True, allow_unused=True)
        except RuntimeError as e:  # e.g. a saved tensor changed in place: not differentiable as run
            return _jacobian_skipped(ctx, f"its graph cannot be differentiated ({type(e).__name__}: {e})")
        g = torch.zeros_like(wrt) if g is None else g.detach().double().abs().nan_to_num(0.0, 0.0, 0.0)
        future.append(float(g[:, s + 1 :].amax()) if g[:, s + 1 :].numel() else 0.0)
        own.append(float(g[:, : s + 1].amax()))
    tol = torch.finfo(value_BTF.dtype).eps * max(own)
    moved = [s for s, f in zip(ctx.cuts, future) if f > tol]
    return ProbeResult(
        name="jacobian",
        mode=ctx.mode,
        kind="future",
        compares_forwards=False,
        leaks=bool(moved),
        max_abs_delta=max(future, default=0.0),
        first_leaking_position=moved[0] if moved else None,
        leaking_positions=moved,
        found_by="d output[s] / d input[> s] nonzero" if moved else None,
        fraction_affected=len(moved) / len(ctx.cuts) if ctx.cuts else 0.0,
        tolerance=tol if math.isfinite(tol) else 0.0,
        comparisons=len(ctx.cuts),
    )


def _jacobian_skipped(ctx: ProbeContext, why: str) -> ProbeResult:
    return ProbeResult(
        name="jacobian",
        mode=ctx.mode,
        kind="future",
        compares_forwards=False,
        leaks=False,
        max_abs_delta=0.0,
        first_leaking_position=None,
        fraction_affected=0.0,
        skipped=why,
    )


def _why_no_gradient(ctx: ProbeContext) -> str:
    if ctx.base.value_BTF is None:
        return "the output is integer or bool: it has no gradient to read"
    if ctx.sampler.tokens:
        return "no gradient reaches the output from an nn.Embedding reading the token ids"
    return "the output has no gradient with respect to the input"


def _takes_another_path(ctx: ProbeContext, value_BTF: torch.Tensor) -> bool:
    """The forward with gradients gives other outputs than the (no-grad) forward of the example
    (told only for a target that repeats itself: otherwise it runs)."""
    if ctx.base.value_BTF is None or ctx.repeat_tolerance is None:
        return False
    with_grad = Outputs(value_BTF.detach().double(), None, value_BTF.dtype)
    _, flips_S, excess_S = difference(ctx.base, with_grad, ctx.t, None, ctx.repeat_tolerance)
    return bool(flips_S.sum()) or float(excess_S.max()) > 1


def decode_consistency(ctx: ProbeContext) -> Iterator[Variant]:
    for c in ctx.cuts:
        yield Variant(ctx.x[:, : c + 1], c + 1, label=f"the prefix 0..{c} alone")


register_probe(Probe("random_future", "future", variants=random_future))
register_probe(Probe("adversarial_future", "future", variants=adversarial_future))
register_probe(Probe("jacobian", "future", measure=jacobian))
register_probe(Probe(BATCH_PROBE, "batch", variants=batch_interference))
register_probe(Probe(DECODE_PROBE, "decode", variants=decode_consistency))
