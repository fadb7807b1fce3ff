"""Flooding variants: inputs built to compete for (or leave) the experts that other tokens use.

Shape legend: B batch, T sequence, D input features per position, F output features per
position, E experts, R future positions (T - t - 1).

A capacity-limited router leaks only when some expert overflows, and a random input rarely
overflows one: an early token is evicted only when more than C later assignments land on its
expert. Copies do that without knowing the router: a future made of *exact* copies of one
position routes every future token exactly as that position routes (scaled copies route
alike for a bias-free gate, and win score-ordered slots); copies of one position of one sample
put in *every* sample's future fill an expert over a whole flattened batch. Sources are chosen
to route differently (:meth:`ProbeContext.sources`), so every expert gets flooded.

``adversarial_future`` builds futures for a few cuts; ``batch_interference`` builds other
samples (and, the other way round, a changed sample 0 watched from every other sample).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from moe.audit.comparator import Variant, spread
from moe.audit.context import ProbeContext
from moe.audit.runner import TargetFailure

ADVERSARIAL_CUTS = 5
"""Cut positions for the adversarial probe (spread over 0..T-2, ends included)."""
MAX_EXPERTS_FLOODED = 4
"""Experts flooded / drained per router and cut: the ones earlier tokens use most; also the
earlier positions of each sample whose copies fill its future."""
MAX_SOURCES = 16
"""Positions of the whole example whose copies fill every sample's future (per cut)."""
FLOOD_SCALE = 3.0
"""Scaled floods have this many times the input of the position they copy (or, along gate
vectors, of the mean norm of an input position)."""
GRADIENT_STEPS = 3
"""Signed-gradient steps of the search for opaque targets."""
GRADIENT_CUTS = 3
"""Cut positions (of the adversarial ones) where opaque targets get the gradient search."""


def _filled(x: Tensor, b: int, r: int, scale: float = 1.0) -> Tensor:
    """[b, r, ...] copies of one position x [...] (times ``scale`` for float inputs)."""
    one = x.reshape(1, 1, *x.shape).expand(b, r, *x.shape)
    return one * scale if x.is_floating_point() and scale != 1.0 else one


def _scales(ctx: ProbeContext) -> tuple[float, ...]:
    return (1.0,) if ctx.sampler.tokens else (1.0, FLOOD_SCALE, -FLOOD_SCALE)


def _how(scale: float) -> str:
    return "exact" if scale == 1.0 else f"x{scale:g}"


# -- adversarial future --------------------------------------------------------------------------
def adversarial_future(ctx: ProbeContext) -> Iterator[Variant]:
    gen = ctx.gen(3)
    cuts = spread(ctx.cuts, ADVERSARIAL_CUTS)
    search = not ctx.sampler.tokens and not ctx.gates and ctx.base.value_BTF is not None and ctx.differentiable
    for c in cuts:
        yield from _floods(ctx, c, gen)
        if search and c in spread(cuts, GRADIENT_CUTS):
            yield from _gradient_floods(ctx, c)


def _floods(ctx: ProbeContext, c: int, gen: torch.Generator) -> Iterator[Variant]:
    """Futures after cut c: the past repeated (scaled), each sample's future made of copies of
    one of its earlier positions, every sample's future made of copies of one position of the
    example, token ids a router favours or shuns, and floods along input-reading gate vectors."""
    past, r, b = ctx.x[:, : c + 1], ctx.t - c - 1, ctx.b
    idx = torch.arange(r, device=past.device) % past.shape[1]
    for s in (1.0,) if ctx.sampler.tokens else (FLOOD_SCALE, -FLOOD_SCALE):
        yield ctx.with_future(c, past[:, idx] * s if s != 1.0 else past[:, idx], f"the past repeated {_how(s)}")
    for p in spread(list(range(c + 1)), MAX_EXPERTS_FLOODED):
        one = past[:, p : p + 1]
        for s in _scales(ctx):
            future = one.expand(b, r, *past.shape[2:])
            yield ctx.with_future(
                c, future * s if s != 1.0 else future, f"each sample's future = {_how(s)} copies of its position {p}"
            )
    for sb, q in ctx.sources(MAX_SOURCES):
        for s in _scales(ctx)[:2]:
            yield ctx.with_future(
                c, _filled(ctx.x[sb, q], b, r, s), f"every sample's future = {_how(s)} copies of x[{sb}, {q}]"
            )
    for i in ctx.flood_ids if ctx.sampler.tokens else ():
        yield ctx.with_future(c, torch.full((b, r), i, dtype=past.dtype, device=past.device), f"every future id = {i}")
    for gate_ED in ctx.gates:
        for label, f in gate_floods(ctx, past, r, gate_ED, gen):
            yield ctx.with_future(c, f, label)


def gate_floods(
    ctx: ProbeContext, past: Tensor, r: int, gate_ED: Tensor, gen: torch.Generator
) -> list[tuple[str, Tensor]]:
    """(label, [B, R, D] future) along one router's gate vectors: every position on the favourite
    expert of each earlier position in turn (mixed), and per expert earlier positions use most,
    all on it (flood) or all away from it (drain)."""
    u_ED = (gate_ED / gate_ED.norm(dim=1, keepdim=True).clamp_min(1e-12)).to(past.dtype)
    norm = float(ctx.x.detach().double().norm(dim=-1).mean())
    mag = FLOOD_SCALE * (norm if norm > 0 else 1.0)
    logits_BSE = past.detach() @ u_ED.T
    top_BS = logits_BSE.argmax(-1)
    idx = torch.arange(r, device=past.device) % past.shape[1]

    def noise() -> Tensor:  # breaks ties between flooding positions
        return 0.05 * mag * torch.randn((past.shape[0], r, u_ED.shape[1]), generator=gen).to(past)

    out = [("along the gate of each earlier position's expert", mag * u_ED[top_BS[:, idx]] + noise())]
    k = min(MAX_EXPERTS_FLOODED, u_ED.shape[0])
    counts_E = torch.bincount(logits_BSE.topk(min(2, u_ED.shape[0]), dim=-1).indices.flatten(), minlength=u_ED.shape[0])
    for e in counts_E.topk(k).indices.tolist():
        out.append((f"every position on expert {e}'s gate", mag * u_ED[e].expand(past.shape[0], r, -1) + noise()))
        out.append(
            (f"every position away from expert {e}'s gate", -mag * u_ED[e].expand(past.shape[0], r, -1) + noise())
        )
    return out


def _gradient_floods(ctx: ProbeContext, cut: int) -> Iterator[Variant]:
    """Signed-gradient search over the future positions, for opaque differentiable targets:
    push their outputs along (flood) or against (drain) the mean output of positions <= cut,
    and along each of the output features those positions use most (for a router's dense
    weights: each expert the earlier tokens chose)."""
    u_BF = ctx.base.value_BTF[:, : cut + 1].nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).mean(1)
    directions = [u_BF]
    for f in u_BF.abs().sum(0).topk(min(MAX_EXPERTS_FLOODED // 2, u_BF.shape[1])).indices.tolist():
        d_BF = torch.zeros_like(u_BF)
        d_BF[:, f] = u_BF[:, f].sign()
        directions.append(d_BF)
    for d_BF in directions:
        for sign in (1.0, -1.0):
            x = ctx.x.detach().clone()
            for _ in range(GRADIENT_STEPS):
                try:
                    value_BTF, wrt = ctx.runner.forward_with_grad(x)
                except TargetFailure:
                    break
                objective = (
                    sign * (value_BTF[:, cut + 1 :].nan_to_num(0.0, 0.0, 0.0) * d_BF[:, None].to(value_BTF)).sum()
                )
                try:
                    (grad,) = torch.autograd.grad(objective, wrt, allow_unused=True)
                except RuntimeError:  # the target's graph cannot be differentiated after all
                    break
                if grad is None:
                    break
                x[:, cut + 1 :] = (x[:, cut + 1 :] + ctx.sampler.std * grad[:, cut + 1 :].sign()).detach()
            yield ctx.with_future(cut, x[:, cut + 1 :], "a signed-gradient search on the future")


# -- batch interference --------------------------------------------------------------------------
def batch_interference(ctx: ProbeContext) -> Iterator[Variant]:
    """Sample 0 among changed other samples (resampled, copies of sample 0, copies of one of its
    positions, floods along gate vectors, token ids routers favour), compared at sample 0; and
    alone (B = 1). Then, for B > 1, sample 0 changed (resampled, copies of one position of
    another sample), compared at every other sample; and the other samples made of copies of
    one position of the last sample, compared at the last."""
    yield from _others_changed(ctx)
    if ctx.b > 1:
        yield Variant(ctx.x[:1], ctx.t, rows=(0,), label="sample 0 alone")
        yield from _first_changed(ctx)
        yield from _last_watched(ctx)


def _others_changed(ctx: ProbeContext) -> Iterator[Variant]:
    gen = ctx.gen(6)
    others = max(ctx.b, 2) - 1
    shape = (others, *ctx.x.shape[1:])
    x0 = ctx.x[:1]
    blocks = [("the other samples resampled", ctx.sampler.draw(shape, gen)) for _ in range(ctx.trials)]
    for s in _scales(ctx):
        blocks.append((f"the other samples = {_how(s)} copies of sample 0", (x0 * s if s != 1.0 else x0).expand(shape)))
    for _, q in ctx.sources(MAX_EXPERTS_FLOODED, samples=[0]):
        for s in _scales(ctx)[:2]:
            blocks.append((f"the other samples = {_how(s)} copies of x[0, {q}]", _filled(x0[0, q], others, ctx.t, s)))
    for i in ctx.flood_ids if ctx.sampler.tokens else ():
        blocks.append((f"the other samples = id {i}", torch.full(shape, i, dtype=x0.dtype, device=x0.device)))
    for gate_ED in ctx.gates:
        blocks += [(label, f[:1].expand(shape)) for label, f in gate_floods(ctx, x0, ctx.t, gate_ED, gen)]
    for label, blk in blocks:
        yield Variant(torch.cat([x0, blk]), ctx.t, rows=(0,), label=label)


def _last_watched(ctx: ProbeContext) -> Iterator[Variant]:
    """Every sample but the last made of copies of one position of the last sample, compared at
    the last: a router that counts capacity over the flattened batch in sample order serves
    sample 0 first, so only a later sample can show that the others crowd it out."""
    last = ctx.b - 1
    for _, q in ctx.sources(MAX_EXPERTS_FLOODED, samples=[last]):
        for s in _scales(ctx)[:2]:
            x = ctx.x.clone()
            x[:last] = _filled(ctx.x[last, q], last, ctx.t, s)
            yield Variant(x, ctx.t, rows=(last,), label=f"the other samples = {_how(s)} copies of x[{last}, {q}]")


def _first_changed(ctx: ProbeContext) -> Iterator[Variant]:
    gen = ctx.gen(8)
    rest = tuple(range(1, ctx.b))
    firsts = [("sample 0 resampled", ctx.sampler.draw(tuple(ctx.x.shape[1:]), gen)) for _ in range(ctx.trials)]
    for sb, q in ctx.sources(MAX_EXPERTS_FLOODED, samples=list(rest)):
        for s in _scales(ctx)[:2]:
            firsts.append((f"sample 0 = {_how(s)} copies of x[{sb}, {q}]", _filled(ctx.x[sb, q], 1, ctx.t, s)[0]))
    for label, first in firsts:
        x = ctx.x.clone()
        x[0] = first
        yield Variant(x, ctx.t, rows=rest, label=label + " (compared at the other samples)")
