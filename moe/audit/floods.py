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

ADVERSARIAL_CUTS = 4
"""Cut positions for the adversarial probe: 0 (the longest future, which overflows capacities
counted over many later tokens) and T/4, T/2, 3T/4."""
OWN_POSITIONS = 2
"""Earlier positions of each sample whose copies fill its future (per cut)."""
SOURCES = 4
"""Positions of the whole example whose copies fill every sample's future (per cut; twice as
many at cut 0): one per distinct largest output feature first (for a router's weights, one per
top expert), then spread."""
MAX_EXPERTS_FLOODED = 2
"""Experts flooded / drained along a router's gate vectors per cut: the ones earlier tokens use most."""
FLOOD_SCALE = 3.0
"""Scaled floods have this many times the input of the position they copy (or, along gate
vectors, of the mean norm of an input position)."""
BATCH_SOURCES = 2
"""Positions whose copies fill the other samples in the batch probe (per way of filling them)."""
FEW_IDS = 3
"""Copies of a special id in a future that holds a few of them (besides one copy and a flood)."""
BESIDE = 2
"""Adversarial futures the batch probe runs beside a copy of the example (each in both orders)."""


def _filled(x: Tensor, b: int, r: int, scale: float = 1.0) -> Tensor:
    """[b, r, ...] copies of one position x [...] (times ``scale`` for float inputs)."""
    one = x.reshape(1, 1, *x.shape).expand(b, r, *x.shape)
    return one * scale if x.is_floating_point() and scale != 1.0 else one


def _scales(ctx: ProbeContext) -> tuple[float, ...]:
    return (1.0,) if ctx.sampler.tokens else (1.0, FLOOD_SCALE)


def _how(scale: float) -> str:
    return "exact" if scale == 1.0 else f"x{scale:g}"


def adversarial_cuts(t: int, quick: bool = False) -> list[int]:
    """0, T/4, T/2, 3T/4 (distinct, below T - 1); 0 and T/2 for a quick audit."""
    n = ADVERSARIAL_CUTS // 2 if quick else ADVERSARIAL_CUTS
    return sorted({min(t - 2, round(i * t / n)) for i in range(n)})


# -- adversarial future --------------------------------------------------------------------------
def adversarial_future(ctx: ProbeContext) -> Iterator[Variant]:
    gen = ctx.gen(3)
    cuts = adversarial_cuts(ctx.t, ctx.quick)
    for c in cuts:
        yield from _floods(ctx, c, gen)
        if ctx.sampler.tokens:
            yield from _special_ids(ctx, c, own_ids=c in cuts[:3])


def _floods(ctx: ProbeContext, c: int, gen: torch.Generator) -> Iterator[Variant]:
    """Futures after cut c: every sample's future made of copies of one position of the example,
    each sample's future made of copies of one of its earlier positions, the past repeated, token
    ids a router favours or shuns, and floods along input-reading gate vectors."""
    past, r, b = ctx.x[:, : c + 1], ctx.t - c - 1, ctx.b
    for sb, q in ctx.sources(SOURCES * (2 if c == 0 else 1)):
        for s in _scales(ctx):
            yield ctx.with_future(
                c, _filled(ctx.x[sb, q], b, r, s), f"every sample's future = {_how(s)} copies of x[{sb}, {q}]"
            )
    for p in spread(list(range(c + 1)), OWN_POSITIONS):
        one = past[:, p : p + 1]
        for s in _scales(ctx):
            future = one.expand(b, r, *past.shape[2:])
            yield ctx.with_future(
                c, future * s if s != 1.0 else future, f"each sample's future = {_how(s)} copies of its position {p}"
            )
    idx = torch.arange(r, device=past.device) % past.shape[1]
    for s in (1.0,) if ctx.sampler.tokens else (FLOOD_SCALE, -FLOOD_SCALE):
        yield ctx.with_future(c, past[:, idx] * s if s != 1.0 else past[:, idx], f"the past repeated {_how(s)}")
    for i in ctx.flood_ids if ctx.sampler.tokens else ():
        yield ctx.with_future(c, torch.full((b, r), i, dtype=past.dtype, device=past.device), f"every future id = {i}")
    for gate_ED in ctx.gates:
        for label, f in gate_floods(ctx, past, r, gate_ED, gen):
            yield ctx.with_future(c, f, label)


def _special_ids(ctx: ProbeContext, c: int, own_ids: bool) -> Iterator[Variant]:
    """Token futures holding the ids a target may treat specially (:attr:`Sampler.special_ids`):
    for the smallest, largest and named ids, every future position that id, and the example's
    own future with the id at one position (right after the cut, the last) or a few (a switch
    that fires on exactly one marker in the sequence sees no flood); and, where
    ``own_ids``, the example's own ids in turn, R of them in every sample's future per variant,
    so each of them stands after the cut in every sample once (an end-of-document id, a padding
    id or a separator in the example is tried wherever the example put it)."""
    special = ctx.sampler.special_ids
    b, r = ctx.b, ctx.t - c - 1
    like = ctx.x
    for why in ("smallest", "largest", "named"):
        yield from _id_floods(ctx, c, (why,))
        for i in special.get(why, []):
            for at in _few_positions(c + 1, ctx.t):
                future = like[:, c + 1 :].clone()
                future[:, [q - c - 1 for q in at]] = i
                where = f"position {at[0]}" if len(at) == 1 else f"positions {', '.join(map(str, at))}"
                yield ctx.with_future(c, future, f"id {i} ({why}) at {where} of every sample's future, else as is")
    own = special.get("the example's own", []) if own_ids else []
    for start in range(0, len(own), r):
        shown = [own[(start + j) % len(own)] for j in range(r)]
        future = torch.tensor(shown, dtype=like.dtype, device=like.device).expand(b, r)
        yield ctx.with_future(c, future, f"every sample's future = the example's ids {shown[0]}..{shown[-1]}")


def _id_floods(ctx: ProbeContext, c: int, whys: tuple[str, ...]) -> Iterator[Variant]:
    """Every future position after cut c one special id, for each id of the kinds ``whys``."""
    b, r, like = ctx.b, ctx.t - c - 1, ctx.x
    for why in whys:
        for i in ctx.sampler.special_ids.get(why, []):
            yield ctx.with_future(
                c, torch.full((b, r), i, dtype=like.dtype, device=like.device), f"every future id = {i} ({why})"
            )


def _few_positions(first: int, t: int) -> list[list[int]]:
    """Where a future from ``first`` to T - 1 holds one special id, or a few (:data:`FEW_IDS`):
    one copy right after the cut, one at the last position, a few spread over the future."""
    future = list(range(first, t))
    out = [[first], [t - 1], spread(future, FEW_IDS)]
    return [list(q) for q in dict.fromkeys(tuple(q) for q in out)]


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


# -- batch interference --------------------------------------------------------------------------
def batch_interference(ctx: ProbeContext) -> Iterator[Variant]:
    """For B > 1, first the other samples made of copies of one position of the last sample,
    compared at the last (what finds a capacity counted over the flattened batch most often);
    then sample 0 among changed other samples (resampled, copies of sample 0, copies of one of its
    positions, floods along gate vectors, token ids routers favour), compared at sample 0; sample
    0 changed (resampled, copies of one position of another sample), compared at every other
    sample; and sample 0 alone (B = 1)."""
    if ctx.b > 1:
        yield from _last_watched(ctx)
    yield from _others_changed(ctx)
    if ctx.b > 1:
        yield from _first_changed(ctx)
        yield Variant(ctx.x[:1], ctx.t, rows=(0,), label="sample 0 alone")
    if ctx.regime == "deterministic":
        yield from _beside_the_example(ctx)


def _beside_the_example(ctx: ProbeContext) -> Iterator[Variant]:
    """A few of the adversarial futures (after cut 0: the special ids, then copies of one
    position) as a batch of their own beside a copy of the example, either order: each compared
    with itself alone. Perturbed copies share forwards only when this finds nothing, so a batch
    statistic such inputs move (the longest document, the fullest expert) is seen here, and
    never hidden by the example's copy in a pack."""
    futures = list(_id_floods(ctx, 0, ("named", "smallest", "largest"))) if ctx.sampler.tokens else []
    futures += list(_floods(ctx, 0, ctx.gen(3)))[: len(_scales(ctx))]
    rows = tuple(range(ctx.b))
    for v in futures[:BESIDE]:
        yield Variant(torch.cat([v.x, ctx.x]), ctx.t, rows=rows, label=f"{v.label}, beside the example", reference=v.x)
        yield Variant(torch.cat([ctx.x, v.x]), ctx.t, rows=rows, label=f"the example beside: {v.label}")


def _others_changed(ctx: ProbeContext) -> Iterator[Variant]:
    gen = ctx.gen(6)
    others = max(ctx.b, 2) - 1
    shape = (others, *ctx.x.shape[1:])
    x0 = ctx.x[:1]
    blocks = [("the other samples resampled", ctx.sampler.draw(shape, gen))]
    blocks.append(("the other samples = exact copies of sample 0", x0.expand(shape)))
    for _, q in ctx.sources(BATCH_SOURCES, samples=[0]):
        blocks.append((f"the other samples = exact copies of x[0, {q}]", _filled(x0[0, q], others, ctx.t)))
    for i in ctx.flood_ids[:BATCH_SOURCES] if ctx.sampler.tokens else ():
        blocks.append((f"the other samples = id {i}", torch.full(shape, i, dtype=x0.dtype, device=x0.device)))
    for gate_ED in ctx.gates:
        label, flood = gate_floods(ctx, x0, ctx.t, gate_ED, gen)[0]
        blocks.append((label, flood[:1].expand(shape)))
    for label, blk in blocks:
        yield Variant(torch.cat([x0, blk]), ctx.t, rows=(0,), label=label)


def _last_watched(ctx: ProbeContext) -> Iterator[Variant]:
    """Every sample but the last made of copies of one position of the last sample, compared at
    the last: a router that counts capacity over the flattened batch in sample order serves
    sample 0 first, so only a later sample can show that the others crowd it out."""
    last = ctx.b - 1
    for _, q in ctx.sources(BATCH_SOURCES, samples=[last]):
        for s in _scales(ctx):
            x = ctx.x.clone()
            x[:last] = _filled(ctx.x[last, q], last, ctx.t, s)
            yield Variant(x, ctx.t, rows=(last,), label=f"the other samples = {_how(s)} copies of x[{last}, {q}]")


def _first_changed(ctx: ProbeContext) -> Iterator[Variant]:
    gen = ctx.gen(8)
    rest = tuple(range(1, ctx.b))
    firsts = [("sample 0 resampled", ctx.sampler.draw(tuple(ctx.x.shape[1:]), gen))]
    for sb, q in ctx.sources(1, samples=list(rest)):
        firsts.append((f"sample 0 = exact copies of x[{sb}, {q}]", _filled(ctx.x[sb, q], 1, ctx.t)[0]))
    for label, first in firsts:
        x = ctx.x.clone()
        x[0] = first
        yield Variant(x, ctx.t, rows=rest, label=label + " (compared at the other samples)")
