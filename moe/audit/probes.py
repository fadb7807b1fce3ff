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
from torch import Tensor

from moe.audit.calibration import difference
from moe.audit.comparator import Variant, spread
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
    # Random signs: sum_f w_f d out[s, f] / d in[r] cannot cancel for every draw, and equals the
    # Jacobian entry itself where each input feature moves a single output feature. A NaN output
    # has no gradient to read (weight 0 there). One row per (output, cut), so a leak is named by
    # the output that has it.
    parts = ctx.base.float_parts
    w_CBF = (torch.randint(0, 2, (len(ctx.cuts), *value_BTF[:, 0].shape), generator=gen) * 2 - 1).to(value_BTF)
    w_CBF = w_CBF * torch.isfinite(value_BTF.detach())[:, ctx.cuts].transpose(0, 1)
    rows = [(k, i, s) for k in range(len(parts)) for i, s in enumerate(ctx.cuts)]
    g_RBTF = torch.zeros((len(rows), *value_BTF.shape), dtype=value_BTF.dtype, device=value_BTF.device)
    for r, (k, i, s) in enumerate(rows):
        g_RBTF[r, :, s, parts[k].start : parts[k].stop] = w_CBF[i, :, parts[k].start : parts[k].stop]
    try:
        g_RBT = _gradient_rows(value_BTF, wrt, g_RBTF)
    except RuntimeError as e:  # e.g. a saved tensor changed in place: not differentiable as run
        return _jacobian_skipped(ctx, f"its graph cannot be differentiated ({type(e).__name__}: {e})")
    future = [float(g_RBT[r, :, s + 1 :].amax()) if s + 1 < ctx.t else 0.0 for r, (_, _, s) in enumerate(rows)]
    own = [float(g_RBT[r, :, : s + 1].amax()) for r, (_, _, s) in enumerate(rows)]
    moved, outputs, largest, excess, tolerance = set(), [], 0.0, 0.0, 0.0
    for k, part in enumerate(parts):
        mine = [r for r, row in enumerate(rows) if row[0] == k]
        tol = torch.finfo(part.dtype or value_BTF.dtype).eps * max(own[r] for r in mine)
        tol = tol if math.isfinite(tol) else 0.0
        hits = {rows[r][2] for r in mine if future[r] > tol}
        if hits:
            outputs.append(part.name)
        moved |= hits
        top = max(future[r] for r in mine)
        largest, tolerance = max(largest, top), max(tolerance, tol)
        excess = max(excess, top / max(tol, torch.finfo(torch.float64).tiny))
    moved = sorted(moved)
    return ProbeResult(
        name="jacobian",
        mode=ctx.mode,
        kind="future",
        compares_forwards=False,
        leaks=bool(moved),
        max_abs_delta=largest,
        first_leaking_position=moved[0] if moved else None,
        leaking_positions=moved,
        found_by="d output[s] / d input[> s] nonzero" if moved else None,
        fraction_affected=len(moved) / len(ctx.cuts) if ctx.cuts else 0.0,
        tolerance=tolerance,
        excess=excess,
        regime="deterministic" if ctx.regime == "deterministic" else "seeded",
        comparisons=len(ctx.cuts),
        leaking_outputs=outputs,
    )


def _gradient_rows(value_BTF: Tensor, wrt: Tensor, g_RBTF: Tensor) -> Tensor:
    """|d (sum g_RBTF[r] * value_BTF) / d wrt| per row r, the largest over its trailing axes:
    float64 [R, B, T]. One batched backward (``is_grads_batched``), or one per row where the
    target's ops cannot be batched."""
    try:
        (g,) = torch.autograd.grad(value_BTF, wrt, g_RBTF, retain_graph=True, allow_unused=True, is_grads_batched=True)
        grads = [g] if g is not None else None
    except RuntimeError:  # an op without a batching rule: one backward per row
        grads = []
        for row in g_RBTF:
            (g,) = torch.autograd.grad(value_BTF, wrt, row, retain_graph=True, allow_unused=True)
            if g is None:
                grads = None
                break
            grads.append(g[None])
    if grads is None:
        return torch.zeros(g_RBTF.shape[0], *wrt.shape[:2], dtype=torch.float64)
    g = torch.cat(grads).detach().double().abs().nan_to_num(0.0, 0.0, 0.0)
    return g.reshape(*g.shape[:3], -1).amax(-1)


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
    with_grad = Outputs(value_BTF.detach().double(), None, ctx.base.dtype, ctx.base.float_parts)
    _, flips_S, excess_S = difference(ctx.base, with_grad, ctx.t, None, ctx.repeat_tolerance)
    return bool(flips_S.sum()) or float(excess_S.max()) > 1


DECODE_PREFIXES = 8
"""Prefix lengths compared by the decode probe (spread over 1..T-1; lengths the target rejects
are replaced by others)."""


def decode_consistency(ctx: ProbeContext) -> Iterator[Variant]:
    """The prefixes 0..c alone: DECODE_PREFIXES spread over the cuts first, then every other cut
    (tried only while some of the first were rejected, see ``Probe.enough``)."""
    first = spread(ctx.cuts, DECODE_PREFIXES)
    for c in first + [c for c in ctx.cuts if c not in first]:
        yield Variant(ctx.x[:, : c + 1], c + 1, label=f"the prefix 0..{c} alone")


register_probe(Probe("random_future", "future", variants=random_future))
register_probe(Probe("adversarial_future", "future", variants=adversarial_future, stop_at_first=True))
register_probe(Probe("jacobian", "future", measure=jacobian))
register_probe(Probe(BATCH_PROBE, "batch", variants=batch_interference, stop_at_first=True))
register_probe(Probe(DECODE_PROBE, "decode", variants=decode_consistency, enough=DECODE_PREFIXES))
