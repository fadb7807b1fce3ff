"""The probes in one place: what a probe is given (``ProbeContext``), the registry of probes
(``register_probe``), the built-in probes and their variants (random futures, floods,
the Jacobian, batch interference, decode consistency) and the check of a flattened output's
row order.

What a probe is given: the example, fresh positions to draw, the cut positions, seeded
generators, and a few facts about the target found once per mode (its gate vectors, the token
ids its routers favour, positions that route differently).

Shape legend: B batch, T sequence, D input features per position, F output features per
position, R future positions (T - t - 1).

The probes the audit runs, by name: each declares its kind and how it makes its variants.

    from moe.audit.probes import Probe, register_probe
    register_probe(Probe("reversed_future", "future", variants=my_variants))   # runs in every audit after

A probe either makes ``variants`` (inputs the comparator judges against the example: these
count towards the significance level of the distribution regime, see
:func:`moe.audit.comparator.per_comparison_alpha`) or ``measure``-s its own result (the
Jacobian reads gradients). Its ``kind`` says what a leak means (:data:`moe.audit.report.KINDS`).
Within a mode the audit runs the "batch" probes first (whether perturbed copies may share a
forward depends on them), then the others in registration order.

Flooding variants: inputs built to compete for (or leave) the experts that other tokens use.

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

The row order of each flattened [B * T, ...] output: rows b * T + t (``x.view(-1, D)`` of a
[B, T, D] input, Hugging Face's order) or t * B + b (time-major, Megatron's [T, B] order).

Shape legend: B batch, T sequence, N = B * T rows, W an output's values per row.

Both orders have the same shape, so the audit tells them apart from what the target does: one
position q alone is changed in every sample (q = T - 1 first) and the rows that moved are read
both ways. A causal field moves at positions >= q only, so in the right order no moved row sits
before q, while in the wrong one some do (row q of sample 0 is row q, position q // B read
time-major; row (T - 1) * B of a time-major field is sample (T - 1) * B // T read the other way).
A change can move no row at all (a pre-gated router routes token t from token t - 1, so nothing
is routed from the last token), or fit both orders (only rows the two readings agree on): then
the next position is tried. A field no position tells (one that leaks, or is random) is read as
b * T + t, and its note says what the changes did, never more.

The built-in probes, registered in this order:

Shape legend: B batch, T sequence, F output features per position.

1. ``random_future`` (future): resample positions > t, for every cut t (0 and T-2 included,
   up to 16 cuts).
2. ``adversarial_future`` (future): futures built to overflow the experts earlier tokens use,
   or to leave them (the floods above). Random perturbations rarely move a token across
   a top-k or capacity cut-off: this probe covers that blind spot.
3. ``jacobian`` (future, measured): |d output[s] / d input[> s]| for every probed s (continuous
   leaks, e.g. statistics over the sequence; blind to discrete ones). Where it finds a gradient,
   it also walks a straight path of float inputs from the example to a random future and names
   the outputs that jump on it (``jump_positions``: a discrete decision behind the gradient, as
   a top-k over tokens behind a softmax over them). Not run (and the report says why) for an
   integer output, a target with no gradient path, or, in eval mode, a target that computes
   other outputs with gradients enabled.
4. ``batch_interference`` (batch): change the other samples and watch one, change one and
   watch every other, run each alone. Reported as ``batch_invariant``, not as a future leak.
5. ``decode_consistency`` (decode): the output at positions <= t from the prefix 0..t alone
   against the full-sequence output, for every prefix length the target accepts (the others
   are reported as skipped).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from moe.audit.comparator import MAX_ROWS, Variant, difference, spread
from moe.audit.report import BATCH_PROBE, DECODE_PROBE, KINDS, ProbeResult
from moe.audit.runner import Runner, TargetFailure, TargetTimeout
from moe.audit.target import AuditTarget, AuditUsageError, OutputError, Outputs, Part, read_outputs

MAX_CUTS = 16
"""Most cut positions t probed per sequence (all of 0..T-2 when T <= 17)."""
MAX_FLOOD_IDS = 8
"""Most token ids kept from the routers' favourites (flood) and least favourites (drain)."""


class Sampler:
    """Fresh input positions: N(mean, std) of the example for floats, uniform ids for tokens;
    for tokens also the ids a target may treat specially (:attr:`special_ids`)."""

    def __init__(self, example: Tensor, vocab_size: int | None, special_ids: tuple[int, ...] | list[int] = ()) -> None:
        if example.dim() < 2 or example.shape[0] < 1 or example.shape[1] < 2:
            raise AuditUsageError(f"the example input must be [B >= 1, T >= 2, ...], got shape {tuple(example.shape)}")
        if example.is_floating_point() and example.dim() < 3:
            raise AuditUsageError(
                f"the example input is float of shape {tuple(example.shape)}: float features must be [B, T, D, ...] "
                "(a sample axis, a time axis, then the features of each position); add the missing axis (x[None] "
                "for one sequence, x[..., None] for one feature per position), or pass token ids as int64 [B, T]"
            )
        self.tokens = not example.is_floating_point()
        self.named = tuple(dict.fromkeys(int(i) for i in special_ids))
        if self.named and not self.tokens:
            raise AuditUsageError("special ids apply to token inputs only; the example is float features")
        if self.tokens:
            if example.dtype not in (torch.int64, torch.int32):
                raise AuditUsageError(f"token ids must be int64 (or int32), got {example.dtype}")
            if vocab_size is None or vocab_size < 1:
                raise AuditUsageError("token inputs need a vocabulary size (vocab_size=...)")
            self.vocab_size = int(vocab_size)
            bad = [i for i in self.named if not 0 <= i < self.vocab_size]
            if bad:
                raise AuditUsageError(f"special ids must lie in [0, {self.vocab_size}), got {bad}")
            self.own = tuple(sorted({int(i) for i in example.flatten().tolist()} - set(self.named)))
        else:
            flat = example.detach().double()
            self.mean, self.std = float(flat.mean()), float(flat.std()) if flat.numel() > 1 else 1.0
            self.std = self.std if self.std > 0 else 1.0
        self.dtype, self.device = example.dtype, example.device

    @property
    def special_ids(self) -> dict[str, list[int]]:
        """Token ids put in futures on purpose, by why: the smallest and largest id (end-of-text
        and padding ids often sit at either end), the ids the user named, and every id of the
        example (an id the target treats specially shows up there when the example is real data)."""
        out = {}
        for why, i in (("smallest", 0), ("largest", self.vocab_size - 1)):
            if i not in self.named and i not in [v for vs in out.values() for v in vs]:
                out[why] = [i]
        extremes = [v for vs in out.values() for v in vs]
        if self.named:
            out["named"] = list(self.named)
        own = [i for i in self.own if i not in extremes]
        if own:
            out["the example's own"] = own
        return out

    def draw(self, shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
        if self.tokens:
            return torch.randint(0, self.vocab_size, shape, generator=gen).to(self.device, self.dtype)
        z = torch.randn(shape, generator=gen, dtype=torch.float64) * self.std + self.mean
        return z.to(self.device, self.dtype)


def probe_generator(seed: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1000 + salt)


def calibration_inputs(x: Tensor, sampler: Sampler, seed: int, n: int = 2) -> list[Tensor]:
    """A few inputs of the example's shape with every position after the first resampled:
    calibration checks that a stochastic target draws the same noise shapes for them."""
    gen = probe_generator(seed, 2)
    out = []
    for _ in range(n):
        v = x.clone()
        v[:, 1:] = sampler.draw((x.shape[0], x.shape[1] - 1, *x.shape[2:]), gen)
        out.append(v)
    return out


class ProbeContext:
    """One example, target, seed and mode as the probes see them (the inputs are the same in
    every mode, so train and eval are probed alike).

    Public to probes: ``x`` (the example), ``b`` / ``t``, ``sampler``, ``trials``, ``cuts``,
    ``mode``, ``base`` (the example's outputs in this mode), ``repeat_tolerance``, ``regime``, ``quick``
    (a pre-commit check: fewer variants), :meth:`gen`,
    :meth:`with_future`;
    ``at`` and ``runner`` for probes that call the target themselves (the Jacobian)."""

    def __init__(
        self,
        at: AuditTarget,
        runner: Runner,
        x: Tensor,
        sampler: Sampler,
        trials: int,
        seed: int,
        mode: str,
        base: Outputs,
        repeat_tolerance: Mapping[str, float] | None = None,
        regime: str = "deterministic",
        quick: bool = False,
    ) -> None:
        self.at, self.runner, self.x, self.sampler, self.trials, self.seed = at, runner, x, sampler, trials, seed
        self.mode, self.base, self.regime, self.quick = mode, base, regime, quick
        self.repeat_tolerance = repeat_tolerance
        """The mode's relative tolerances (per float output) when the example repeats itself under
        one seed (None: it does not, so no single forward can be compared with ``base``)."""
        self.b, self.t = x.shape[0], x.shape[1]
        self.cuts = spread(list(range(self.t - 1)), MAX_CUTS)

    def gen(self, salt: int) -> torch.Generator:
        """A CPU generator seeded from the audit seed and ``salt`` (one salt per probe)."""
        return probe_generator(self.seed, salt)

    def with_future(self, cut: int, future: Tensor, label: str = "") -> Variant:
        """The example with positions > cut replaced by ``future`` [B, T - cut - 1, ...]."""
        x = self.x.clone()
        x[:, cut + 1 :] = future
        return Variant(x, cut + 1, label=label)

    def sources(self, k: int, samples: list[int] | None = None, upto: int | None = None) -> list[tuple[int, int]]:
        """At most k positions (b, q) of the example (of ``samples``, at q < ``upto``; default all)
        whose outputs differ most plainly: first one per distinct largest output feature (for a
        router's weights: one per top expert), then evenly spread over the rest. Copies of them
        fill the experts those positions use."""
        samples = list(range(self.b)) if samples is None else samples
        upto = self.t if upto is None else upto
        out = self.base.value_BTF if self.base.value_BTF is not None else self.base.exact_BTX
        cells = [(b, q) for b in samples for q in range(upto)]
        if out is None:
            return spread(cells, k)
        top = out.reshape(self.b, self.t, -1).abs().nan_to_num(0.0, 0.0, 0.0).argmax(-1)
        first: dict[int, tuple[int, int]] = {}
        for b, q in cells:
            first.setdefault(int(top[b, q]), (b, q))
        chosen = list(first.values())[:k]
        rest = [c for c in cells if c not in chosen]
        return chosen + spread(rest, k - len(chosen)) if len(chosen) < k else chosen

    @property
    def ids_tried(self) -> dict[str, list[int]]:
        """The token ids the adversarial futures hold on purpose (:attr:`Sampler.special_ids`)."""
        return self.sampler.special_ids

    @cached_property
    def gates(self) -> list[Tensor]:
        """[E, D] gate vectors of the routers that read the float input directly."""
        return self.at.gate_vectors(self.x.shape[-1]) if self.x.dim() == 3 and not self.sampler.tokens else []

    @cached_property
    def flood_ids(self) -> list[int]:
        """Token ids that, repeated, each router scores highest (flood) and lowest (drain) per
        expert; found with one forward over sequences of a single repeated id."""
        if not self.at.routers:
            return []
        v = self.sampler.vocab_size
        rows = MAX_ROWS // 4
        ids = torch.arange(v) if v <= rows else torch.randperm(v, generator=self.gen(4))[:rows]
        seq = ids.to(self.x.device, self.x.dtype)[:, None].expand(-1, min(self.t, 8))
        logits: list[Tensor] = []
        hooks = [r.gate.register_forward_hook(lambda _m, _i, o: logits.append(o.detach())) for r in self.at.routers]
        try:
            self.runner.forward(seq)
        except (TargetFailure, TargetTimeout):
            return []  # a target that cannot take this batch shape: no ranked ids
        finally:
            for h in hooks:
                h.remove()
        chosen: list[int] = []
        for lg in logits:
            probs = lg.float().cpu().softmax(-1).reshape(ids.numel(), -1, lg.shape[-1]).mean(1)
            chosen += ids[probs.argmax(0)].tolist() + ids[probs.argmin(0)].tolist()
        return list(dict.fromkeys(chosen))[:MAX_FLOOD_IDS]


@dataclass(frozen=True)
class Probe:
    """One probe of the audit."""

    name: str
    """Unique; the ``name`` of its :class:`ProbeResult` rows."""
    kind: str
    """"future", "batch" or "decode": what its ``leaks`` means."""
    variants: Callable[[ProbeContext], Iterable[Variant]] | None = None
    """Inputs to compare with the example (their ``upto`` and ``rows`` say what is compared)."""
    measure: Callable[[ProbeContext], ProbeResult | None] | None = None
    """Instead of variants: the result itself (None: the probe does not apply to this target)."""
    stop_at_first: bool = False
    """Stop at the first forward that shows a change (the verdict is made; the positions reported
    are those seen until then): for probes whose many variants look for one change anywhere."""
    enough: int | None = None
    """Stop once this many variants were compared (those the target fails on do not count): the
    probe yields its preferred variants first and the rest as stand-ins (None: all of them)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a probe needs a non-empty name, got {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"probe {self.name!r}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if (self.variants is None) == (self.measure is None):
            raise ValueError(f"probe {self.name!r}: give exactly one of variants= and measure=")

    @property
    def compares_forwards(self) -> bool:
        return self.variants is not None


_REGISTRY: dict[str, Probe] = {}


def register_probe(probe: Probe) -> Probe:
    """Add ``probe`` to every audit from now on; a name already registered is a ValueError."""
    if not isinstance(probe, Probe):
        raise ValueError(f"register_probe takes a Probe, got {type(probe).__name__}")
    if probe.name in _REGISTRY:
        raise ValueError(f"a probe named {probe.name!r} is already registered")
    _REGISTRY[probe.name] = probe
    return probe


def unregister_probe(name: str) -> None:
    """Remove the probe ``name``; an unknown name is a ValueError."""
    if name not in _REGISTRY:
        raise ValueError(f"no probe named {name!r}; registered: {', '.join(_REGISTRY)}")
    del _REGISTRY[name]


def registered_probes() -> tuple[Probe, ...]:
    """Every registered probe, in registration order (the built-in five first)."""
    return tuple(_REGISTRY.values())


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
    sample; and every sample alone (B = 1: a route read from the flat index b * T + t, as a
    round-robin assignment makes it, gives sample b other experts alone unless E divides b * T)."""
    if ctx.b > 1:
        yield from _last_watched(ctx)
    yield from _others_changed(ctx)
    if ctx.b > 1:
        yield from _first_changed(ctx)
        for b in range(ctx.b):
            yield Variant(ctx.x[b : b + 1], ctx.t, rows=(0,), label=f"sample {b} alone", ref_rows=(b,))
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


ORDER_POSITIONS = 4
"""Most positions changed (one forward each) to tell the order: T-1, T-2, T-3 and T/2."""


def order_positions(t: int) -> list[int]:
    """The positions changed in turn, latest first; never 0 (every row may move after a change there)."""
    return list(dict.fromkeys(q for q in (t - 1, t - 2, t - 3, t // 2) if q >= 1))[:ORDER_POSITIONS]


def _moved_rows(base: Outputs, moved: Outputs, part: Part) -> Tensor:
    """bool [N]: the rows of one flat output that differ, in the order the target returned them
    (NaN where both have NaN is no change)."""
    a_all, z_all = (base.exact_BTX, moved.exact_BTX) if part.exact else (base.value_BTF, moved.value_BTF)
    a, z = a_all[..., part.start : part.stop], z_all[..., part.start : part.stop]
    same = (a == z) | (a.isnan() & z.isnan()) if not part.exact else a == z
    return (~same).any(-1).reshape(-1)


def _fits(moved_BT: Tensor, q: int) -> bool:
    """Some row moved, and none at a position before q."""
    return bool(moved_BT.any()) and not bool(moved_BT[:, :q].any())


_WHAT_MOVED = {
    "none": "moved none of its rows",
    "both": "moved only rows that fit both orders",
    "neither": "moved rows before the change in either order",
}
"""What a change at a position did to a field whose order it could not tell, by kind."""


def _kind(sample_major: bool, time_major: bool, any_moved: bool) -> str:
    return "none" if not any_moved else "both" if sample_major and time_major else "neither"


def _untold(seen: dict[str, list[int]]) -> str:
    """e.g. "a change at position 15 moved none of its rows; changes at positions 14, 13 moved ..."."""
    parts = []
    for kind, qs in seen.items():
        at = f"a change at position {qs[0]}" if len(qs) == 1 else f"changes at positions {', '.join(map(str, qs))}"
        parts.append(f"{at} {_WHAT_MOVED[kind]}")
    return "; ".join(parts) or "the forward that checks it failed"


def check_lengths(runner: Runner, example: Tensor, base: Outputs) -> bool:
    """Whether some outputs of ``base`` (the example's) were found not to follow the sequence's length,
    and added to ``runner.target.not_per_position``. A field is read per position by its leading axes
    alone, so one whose axis 1 has T entries of something else (a head-major attention map
    [B, H, T, T] with H = T, per-expert counts [B, E] with E = T; a buffer [E * C, D] with
    E * C = B * T read flat) reads as per position at T; a plain forward of the example's first T - 1
    positions (else T // 2) shows whether it keeps its leading axes where the others follow. Nothing
    is decided where no shorter forward runs or no output follows the length."""
    at = runner.target
    b, t = example.shape[:2]
    names = {p.name for p in base.parts}
    for short in dict.fromkeys(n for n in (t - 1, t // 2) if n >= 1):
        try:
            fields, _ = read_outputs(runner.plain(example[:, :short]), b, short, at.output)
        except (TargetFailure, OutputError):
            continue
        now = {f.name: f for f in fields}
        follows = {
            name: name in now and now[name].flat == flat for name, (flat, _) in at.per_position.items() if name in names
        }
        if not any(follows.values()):
            return False
        for name in (name for name, keeps in follows.items() if not keeps):
            at.not_per_position[name] = (
                f"not per position: {b * t} rows at T={t}, not {b * short} at T={short}"
                if at.per_position[name][0]
                else f"not per position: its axis 1 has {t} entries at T={t}, not {short} at T={short}"
            ) + " (as many heads, experts or slots as positions?)"
        return bool(at.not_per_position)
    return False


def check_flat_order(runner: Runner, example: Tensor, base: Outputs, sampler: Sampler, seed: int) -> list[str]:
    """Tell the order of every flat output of ``base`` (the example's outputs, flat ones read as
    rows b * T + t) with forwards that change one position alone; add each time-major one to
    ``runner.target.time_major`` and return the notes the report prints."""
    at = runner.target
    b, t = example.shape[:2]
    undecided = {p.name: p for p in base.parts if p.name in at.flat_fields}
    if not undecided or b < 2:
        return []
    seen: dict[str, dict[str, list[int]]] = {name: {} for name in undecided}
    notes = []
    for q in order_positions(t):
        x = example.clone()
        x[:, q] = sampler.draw((b, *example.shape[2:]), probe_generator(seed, 9 + 100 * q))
        try:
            moved = runner.forward(x).out
        except TargetFailure:
            break
        for name, part in list(undecided.items()):
            moved_N = _moved_rows(base, moved, part)
            sample_major, time_major = _fits(moved_N.reshape(b, t), q), _fits(moved_N.reshape(t, b).T, q)
            if sample_major != time_major:
                del undecided[name]
                if time_major:
                    at.time_major.add(name)
                    notes.append(
                        f"{name}: rows are t*B+b (time-major): a change at position {q} alone moved rows at "
                        f"positions >= {q} only when read so (read as b*T+t, rows before {q} moved)"
                    )
            else:
                seen[name].setdefault(_kind(sample_major, time_major, bool(moved_N.any())), []).append(q)
        if not undecided:
            break
    for name in undecided:
        notes.append(f"{name}: read as rows b*T+t; its row order could not be told: {_untold(seen[name])}")
    return notes


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
        g_RBT, injected = _gradient_rows(value_BTF, wrt, g_RBTF)
    except RuntimeError as e:  # e.g. a saved tensor changed in place: perhaps by the first backward only
        try:
            g_RBT, injected = _gradient_rows(
                value_BTF, wrt, g_RBTF, regraph=lambda: ctx.runner.forward_with_grad(ctx.x)
            )
        except (RuntimeError, TargetFailure):  # not differentiable as run, even once
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
    jumps = path_changes(ctx)[0] if moved else []
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
        probed_positions=sorted({s for s in ctx.cuts if s + 1 < ctx.t}),
        jump_positions=jumps,
        note=INJECTED if injected else None,
    )


INJECTED = (
    "its backward adds a gradient of its own (nonzero for a zero output gradient: an auxiliary loss attached in "
    "backward, as DeepSeek-MoE's AddAuxiliaryLoss or Megatron-Core's MoEAuxLossAutoScaler); that part is "
    "subtracted, the Jacobian read is the outputs' own"
)
"""The Jacobian probe's note where the target's backward is not linear in the output's gradient."""


JUMP_STEPS = 16
"""Steps of the straight path on which :func:`path_changes` looks for a jump (and twice as many)."""

JUMP_HALVINGS = 4
"""Halvings of its largest step that a jump must survive in :func:`path_changes`: a kink (a
maximum over the sequence switching entries) passes the path's own halving, where the change sits
in a fraction of the step, and shrinks with the later ones."""


def path_changes(ctx: ProbeContext, variant: Variant | None = None) -> tuple[list[int], list[int]]:
    """(output positions that jump, positions that move smoothly) along a straight path of float
    inputs from the example to a random future (positions past the middle cut resampled), or to
    ``variant`` (a future of the example's shape; its positions < ``upto`` read): a jump's largest
    change between neighbouring points of the path stays above 3/4 of itself when the steps halve,
    where a continuous output's would halve. A discrete decision (a top-k over positions) behind a
    nonzero Jacobian shows so; a softmax over the tokens alone does not; and a statistic of later
    positions computed without gradient (under ``torch.no_grad()``), or a dependence too weak at
    the example for its gradient to count, moves smoothly where the Jacobian reads nothing. A
    position that passes is a jump only if the change of its largest step, halved
    :data:`JUMP_HALVINGS` times (the larger half each time), does not shrink with the interval
    (:func:`_halvings_keep_the_jump`): a
    continuous output whose slope falls by 4x within a step (Performer's key stabiliser, a detached
    maximum over the sequence, switching entries) passes once. Only for float inputs and a target
    that repeats itself under one seed; ([], []) otherwise or if a forward fails."""
    if not ctx.x.is_floating_point() or ctx.repeat_tolerance is None:
        return [], []
    if variant is None:
        cut = ctx.t // 2 - 1
        variant = ctx.with_future(cut, ctx.sampler.draw((ctx.b, ctx.t - cut - 1, *ctx.x.shape[2:]), ctx.gen(6)))
    path = []
    for k in range(2 * JUMP_STEPS + 1):
        out = _on_the_path(ctx, variant, k / (2 * JUMP_STEPS))
        if out is None:
            return [], []
        path.append(out[:, : variant.upto])
    path_KBTF = torch.stack(path)
    fine_T = path_KBTF.diff(dim=0).abs().amax((0, 1, 3))
    coarse_T = path_KBTF[0::2].diff(dim=0).abs().amax((0, 1, 3))
    scale = max(float(path_KBTF.abs().amax()), torch.finfo(torch.float64).tiny)
    floor = scale * max(ctx.repeat_tolerance.values(), default=0.0)
    moved = [t for t in range(variant.upto) if coarse_T[t] > floor]
    jumps = [
        t
        for t in moved
        if fine_T[t] > 0.75 * coarse_T[t] and _halvings_keep_the_jump(ctx, variant, path_KBTF, t, floor)
    ]
    return jumps, [t for t in moved if t not in jumps]


def _on_the_path(ctx: ProbeContext, variant: Variant, where: float) -> Tensor | None:
    """The outputs (value_BTF, NaN read as 0) at the point ``where`` (0: the example, 1: the
    variant) of :func:`path_changes`' straight path; None where the forward fails or gives none."""
    try:
        out = ctx.runner.forward(torch.lerp(ctx.x, variant.x, where)).out.value_BTF
    except TargetFailure:
        return None
    return None if out is None else out.nan_to_num(0.0, 0.0, 0.0)


def _halvings_keep_the_jump(ctx: ProbeContext, variant: Variant, path_KBTF: Tensor, t: int, floor: float) -> bool:
    """Whether the change of output position ``t`` over its largest step of :func:`path_changes`'
    path (the outputs ``path_KBTF`` at its points) stays above ``floor`` and above 2^(-H/2) of
    itself as the step is halved H = :data:`JUMP_HALVINGS` times, the larger half kept: a jump's
    does (a few jumps in one step, as LSH buckets switching, part and each keeps its own), a
    continuous output's falls towards 2^-H of it once the interval lies where it is smooth. A
    failed forward keeps the jump."""
    values_KBF = path_KBTF[:, :, t]
    step = int((values_KBF.diff(dim=0).abs().amax((1, 2))).argmax())
    ends = [(step / (2 * JUMP_STEPS), values_KBF[step]), ((step + 1) / (2 * JUMP_STEPS), values_KBF[step + 1])]
    change = float((ends[1][1] - ends[0][1]).abs().amax())
    least = change / 2 ** (JUMP_HALVINGS / 2)
    for _ in range(JUMP_HALVINGS):
        where = (ends[0][0] + ends[1][0]) / 2
        out = _on_the_path(ctx, variant, where)
        if out is None:
            return True
        middle = (where, out[:, t])
        halves = [[ends[0], middle], [middle, ends[1]]]
        changes = [float((b[1] - a[1]).abs().amax()) for a, b in halves]
        larger = max(changes)
        if larger <= max(floor, least):
            return False
        ends = halves[changes.index(larger)]
    return True


def _gradient_rows(
    value_BTF: Tensor, wrt: Tensor, g_RBTF: Tensor, regraph: Callable[[], tuple[Tensor, Tensor] | None] | None = None
) -> tuple[Tensor, bool]:
    """(|d (sum g_RBTF[r] * value_BTF) / d wrt| per row r, the largest over its trailing axes:
    float64 [R, B, T]; whether the backward gave a gradient for a zero output gradient). The
    vector-Jacobian product is linear in the output's gradient, so a backward that hands out a
    gradient of its own (an auxiliary loss attached to the output by an autograd function that
    passes the output through and gives the loss a gradient of ones, batch statistics that reach
    every position) shows as the product of a zero row, which is subtracted from every row. One
    batched backward (``is_grads_batched``), or one per row where the target's ops cannot be
    batched. With ``regraph`` (a fresh forward with gradients: (value_BTF, wrt)), every row gets a
    graph of its own: a backward that writes into the tensors its graph saved (scattermoe's
    ParallelLinear reuses them as buffers) runs once per graph."""
    g_RBTF = torch.cat([g_RBTF, torch.zeros_like(g_RBTF[:1])])
    if regraph is not None:
        grads = _row_by_row(g_RBTF, regraph, retain=False)
    else:
        try:
            (g,) = torch.autograd.grad(
                value_BTF, wrt, g_RBTF, retain_graph=True, allow_unused=True, is_grads_batched=True
            )
            grads = [g] if g is not None else None
        except RuntimeError:  # an op without a batching rule: one backward per row
            grads = _row_by_row(g_RBTF, lambda: (value_BTF, wrt), retain=True)
    if grads is None:
        return torch.zeros(g_RBTF.shape[0] - 1, *wrt.shape[:2], dtype=torch.float64), False
    g = torch.cat(grads).detach().double()
    own = g[-1:].nan_to_num(0.0, 0.0, 0.0)
    g = (g[:-1] - own).abs().nan_to_num(0.0, 0.0, 0.0)
    return g.reshape(*g.shape[:3], -1).amax(-1), bool(own.any())


def _row_by_row(g_RBTF: Tensor, graph: Callable[[], tuple[Tensor, Tensor] | None], retain: bool) -> list[Tensor] | None:
    """The gradient of sum(g_RBTF[r] * value_BTF) with respect to wrt, one backward per row r, each on
    the (value_BTF, wrt) that ``graph()`` gives; None where no gradient reaches wrt."""
    grads = []
    for row in g_RBTF:
        value_wrt = graph()
        if value_wrt is None:
            return None
        (g,) = torch.autograd.grad(*value_wrt, row, retain_graph=retain, allow_unused=True)
        if g is None:
            return None
        grads.append(g[None])
    return grads


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
        return (
            "no gradient reaches the output from an embedding reading the token ids as given, [B, T] (an nn.Embedding, "
            "or in a model without one any submodule; one that reads them transposed or reshaped is not looked for)"
        )
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
    """The prefixes 0..c alone: DECODE_PREFIXES spread over the cuts first, then every other cut,
    then up to 2 x DECODE_PREFIXES other lengths, those with the largest power of two dividing
    them first (tried only while some of the first were rejected, see ``Probe.enough``): a chunked
    scan runs at multiples of its chunk only, and at T = 128 no cut gives a length of 64."""
    first = spread(ctx.cuts, DECODE_PREFIXES)
    others = sorted(set(range(ctx.t - 1)) - set(ctx.cuts), key=lambda c: (-((c + 1) & -(c + 1)), c))
    for c in first + [c for c in ctx.cuts if c not in first] + others[: 2 * DECODE_PREFIXES]:
        yield Variant(ctx.x[:, : c + 1], c + 1, label=f"the prefix 0..{c} alone")


register_probe(Probe("random_future", "future", variants=random_future))
register_probe(Probe("adversarial_future", "future", variants=adversarial_future, stop_at_first=True))
register_probe(Probe("jacobian", "future", measure=jacobian))
register_probe(Probe(BATCH_PROBE, "batch", variants=batch_interference, stop_at_first=True))
register_probe(Probe(DECODE_PROBE, "decode", variants=decode_consistency, enough=DECODE_PREFIXES))
