"""The causality audit: does the output at position t ignore inputs at positions > t?

Shape legend: B batch, T sequence, D input features per position, F output features per
position, X exact decisions per position, E experts, R future positions (T - t - 1).

Five probes, each run per mode (training flag on / off):

1. ``random_future``: resample positions > t, for every cut t (0 and T-2 included, up to 16 cuts).
2. ``adversarial_future``: future positions built to compete for the experts that earlier tokens
   use (flooding) or to leave them (draining). With routers that read the input, along their
   gate vectors; always with scaled copies of earlier positions (token ids: copied earlier
   tokens, and the ids each router scores highest / lowest per expert); for an opaque,
   differentiable float target, by a few steps of signed-gradient search. Random perturbations
   rarely move a token across a top-k or capacity cut-off: this probe covers that blind spot.
3. ``jacobian``: |d output[s] / d input[> s]| for every probed s (continuous leaks, e.g. statistics
   over the sequence; blind to discrete ones).
4. ``batch_interference``: resample or flood the *other* samples, or run the sample alone; does
   the probed sample's output move? Reported as ``batch_invariant``, not as a future leak.
5. ``decode_consistency``: the output at positions <= t from the prefix 0..t alone against the
   full-sequence output.

Float outputs leak when the change exceeds the tolerance (10x the noise floor measured by
running the same input twice, at least 100 ulp of the output scale); routing decisions and
integer outputs are compared exactly and counted as flips. Every forward is preceded by the
same RNG seed, so a stochastic target (dropout) sees the same noise for the same shape.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from moe.audit.report import BATCH_PROBE, DECODE_PROBE, AuditReport, ProbeResult
from moe.audit.target import AuditTarget, AuditUsageError, Outputs

MODES = ("train", "eval")
MAX_CUTS = 16
"""Most cut positions t probed per sequence (all of 0..T-2 when T <= 17)."""
ADVERSARIAL_CUTS = 5
"""Cut positions for the adversarial probe (spread over 0..T-2, ends included)."""
MAX_EXPERTS_FLOODED = 4
"""Experts flooded / drained per router and cut: the ones earlier tokens use most."""
MAX_ROWS = 512
"""Most samples in one forward when perturbed copies are concatenated along the batch."""
FLOOD_SCALE = 3.0
"""Flooding inputs have this many times the mean norm of an input position."""
GRADIENT_STEPS = 3
"""Signed-gradient steps of the search for opaque targets."""
GRADIENT_CUTS = 3
"""Cut positions (of the adversarial ones) where opaque targets get the gradient search."""


def audit(
    target: Callable[[Tensor], Any],
    example: Tensor,
    *,
    modes: tuple[str, ...] | list[str] = MODES,
    trials: int = 2,
    seed: int = 0,
    name: str | None = None,
    vocab_size: int | None = None,
) -> AuditReport:
    """Audit ``target`` on inputs shaped like ``example`` and return an :class:`AuditReport`.

    ``target``: an ``nn.Module`` or callable mapping [B, T, ...] (float features or int64 token
    ids) to [B, T, ...]: a tensor, a :class:`~moe.routing.Routing` (compared through ``dense()``
    and exactly through ``mask()``), or a tuple / dataclass whose first tensor is used.
    ``example``: the input the probes perturb (B >= 1, T >= 2). ``trials``: random
    perturbations per cut position. ``vocab_size``: the id range resampled for token inputs
    (default: the first ``nn.Embedding`` of the target, else ``example.max() + 1``).

    The target's parameters, buffers and training flags are restored afterwards, and the global
    RNG state is left as it was.
    """
    start = time.perf_counter()
    modes = tuple(modes)
    for m in modes:
        if m not in MODES:
            raise AuditUsageError(f"unknown mode {m!r}; modes are 'train' and 'eval'")
    if not modes:
        raise AuditUsageError("at least one mode is needed")
    if not isinstance(trials, int) or trials < 1:
        raise AuditUsageError(f"trials must be a positive integer, got {trials!r}")
    if not isinstance(example, Tensor):
        raise AuditUsageError(f"the example input must be a torch.Tensor, got {type(example).__name__}")
    at = AuditTarget(target)
    sampler = _Sampler(example, vocab_size if vocab_size is not None else _vocab_size(at, example))
    report = AuditReport(name=name or _name_of(target), modes=modes, claims=at.claims)
    with torch.random.fork_rng(devices=[]), at.preserved():
        for mode in modes:
            at.set_mode(mode)
            report.probes += _ModeAudit(at, example, mode, sampler, trials, seed).run()
    report.seconds = time.perf_counter() - start
    return report


# -- inputs ---------------------------------------------------------------------------------
class _Sampler:
    """Fresh input positions: N(mean, std) of the example for floats, uniform ids for tokens."""

    def __init__(self, example: Tensor, vocab_size: int | None) -> None:
        if example.dim() < 2 or example.shape[0] < 1 or example.shape[1] < 2:
            raise AuditUsageError(f"the example input must be [B >= 1, T >= 2, ...], got shape {tuple(example.shape)}")
        self.tokens = not example.is_floating_point()
        if self.tokens:
            if example.dtype not in (torch.int64, torch.int32):
                raise AuditUsageError(f"token ids must be int64 (or int32), got {example.dtype}")
            if vocab_size is None or vocab_size < 1:
                raise AuditUsageError("token inputs need a vocabulary size (vocab_size=...)")
            self.vocab_size = int(vocab_size)
        else:
            flat = example.detach().double()
            self.mean, self.std = float(flat.mean()), float(flat.std()) if flat.numel() > 1 else 1.0
            self.std = self.std if self.std > 0 else 1.0
        self.dtype, self.device = example.dtype, example.device

    def draw(self, shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
        if self.tokens:
            return torch.randint(0, self.vocab_size, shape, generator=gen).to(self.device, self.dtype)
        z = torch.randn(shape, generator=gen, dtype=torch.float64) * self.std + self.mean
        return z.to(self.device, self.dtype)


def _vocab_size(at: AuditTarget, example: Tensor) -> int | None:
    if example.is_floating_point():
        return None
    if at.module is not None:
        for m in at.module.modules():
            if isinstance(m, torch.nn.Embedding):
                return m.num_embeddings
    return int(example.max()) + 1


def _name_of(target: Any) -> str:
    return getattr(target, "__name__", None) or type(target).__name__


def _spread(values: list[int], k: int) -> list[int]:
    """At most k of the values, evenly spread, first and last included."""
    if len(values) <= k:
        return list(values)
    idx = sorted({round(i * (len(values) - 1) / (k - 1)) for i in range(k)})
    return [values[i] for i in idx]


# -- bookkeeping ----------------------------------------------------------------------------
class _Tally:
    """Per output position: the largest change, the flips, and whether it ever moved."""

    def __init__(self, name: str, mode: str, t: int) -> None:
        self.name, self.mode = name, mode
        self.delta_T = torch.zeros(t, dtype=torch.float64)
        self.flips_T = torch.zeros(t, dtype=torch.long)
        self.moved_T = torch.zeros(t, dtype=torch.bool)
        self.probed_T = torch.zeros(t, dtype=torch.bool)
        self.comparisons = 0

    def add(self, delta_S: Tensor, flips_S: Tensor, tol: float) -> None:
        s = delta_S.numel()
        self.delta_T[:s] = torch.maximum(self.delta_T[:s], delta_S)
        self.flips_T[:s] += flips_S
        self.moved_T[:s] |= (delta_S > tol) | (flips_S > 0)
        self.probed_T[:s] = True
        self.comparisons += 1

    def result(self, tol: float) -> ProbeResult:
        moved = self.moved_T.nonzero()
        probed = int(self.probed_T.sum())
        return ProbeResult(
            name=self.name,
            mode=self.mode,
            leaks=bool(moved.numel()),
            max_abs_delta=float(self.delta_T.max()) if self.delta_T.numel() else 0.0,
            first_leaking_position=int(moved[0]) if moved.numel() else None,
            fraction_affected=float(self.moved_T.sum()) / probed if probed else 0.0,
            routing_flips=int(self.flips_T.sum()),
            tolerance=tol,
            comparisons=self.comparisons,
        )


def _changes(base: Outputs, other: Outputs, upto: int, exact_ok: bool, sample: slice = slice(None)) -> tuple[Tensor, Tensor]:
    """Per position s < upto: max |float change| (float64 [upto]) and exact flips (int64 [upto])."""
    delta = torch.zeros(upto, dtype=torch.float64)
    flips = torch.zeros(upto, dtype=torch.long)
    if base.value_BTF is not None and other.value_BTF is not None:
        diff = (base.value_BTF[sample, :upto] - other.value_BTF[sample, :upto]).abs()
        delta = diff.nan_to_num(nan=math.inf).amax(dim=(0, 2)).cpu() if diff.numel() else delta
    if exact_ok and base.exact_BTX is not None and other.exact_BTX is not None:
        a, b = base.exact_BTX[sample, :upto], other.exact_BTX[sample, :upto]
        if a.shape[-1] == b.shape[-1]:
            flips = (a != b).sum(dim=(0, 2)).cpu()
    return delta, flips


# -- one mode -------------------------------------------------------------------------------
@dataclass
class _Variant:
    x: Tensor
    """The perturbed input, same shape as the example (for the batch probe: B >= 2)."""
    upto: int
    """Compare output positions < upto."""


class _ModeAudit:
    def __init__(self, at: AuditTarget, x: Tensor, mode: str, sampler: _Sampler, trials: int, seed: int) -> None:
        self.at, self.x, self.mode, self.sampler, self.trials, self.seed = at, x, mode, sampler, trials, seed
        self.b, self.t = x.shape[0], x.shape[1]
        self.gen = torch.Generator().manual_seed(seed)
        self.cuts = _spread(list(range(self.t - 1)), MAX_CUTS)
        self._ids: list[int] | None = None
        self._is_differentiable: bool | None = None

    def forward(self, x: Tensor) -> Outputs:
        self._reseed(x)
        return self.at(x)

    def forward_with_grad(self, x: Tensor) -> tuple[Tensor, Tensor] | None:
        self._reseed(x)
        return self.at.forward_with_grad(x)

    def _reseed(self, x: Tensor) -> None:
        """The same global RNG state before every forward: stochastic layers repeat themselves."""
        torch.default_generator.manual_seed(self.seed)
        if x.is_cuda:
            torch.cuda.manual_seed(self.seed)

    def run(self) -> list[ProbeResult]:
        self.base = self.forward(self.x)
        again = self.forward(self.x)
        floor = self._floor(self.base, again)
        self.exact_ok = self._same_exact(self.base, again)
        self.tol = self._tolerance(floor)
        batch = self._batch_probe()
        claims = self.at.claims
        self.batchable = not batch.leaks and (claims is None or claims.batch_invariant)
        if self.batchable:
            # Copies in one forward may see different noise (dropout) than separate forwards.
            twice = self.forward(torch.cat([self.x, self.x]))
            a, b = twice.rows(0, self.b), twice.rows(self.b, 2 * self.b)
            self.tol = self._tolerance(max(floor, self._floor(a, b)))
            self.exact_ok &= self._same_exact(a, b)
        results = [
            self._compare_all("random_future", self._random_variants()),
            self._compare_all("adversarial_future", self._adversarial_variants()),
        ]
        jac = self._jacobian_probe()
        if jac is not None:
            results.append(jac)
        results += [batch, self._decode_probe()]
        return results

    # -- noise ----------------------------------------------------------------------------
    @staticmethod
    def _floor(a: Outputs, b: Outputs) -> float:
        if a.value_BTF is None:
            return 0.0
        return float((a.value_BTF - b.value_BTF).abs().nan_to_num(nan=math.inf).max())

    @staticmethod
    def _same_exact(a: Outputs, b: Outputs) -> bool:
        return a.exact_BTX is None or torch.equal(a.exact_BTX, b.exact_BTX)

    def _tolerance(self, floor: float) -> float:
        if self.base.value_BTF is None:
            return 0.0
        eps = torch.finfo(self.base.dtype).eps
        scale = float(self.base.value_BTF.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).max())
        return max(10.0 * floor, 100.0 * eps * scale)

    # -- running variants -------------------------------------------------------------------
    def _outputs_of(self, variants: list[_Variant], batched: bool) -> Iterator[tuple[Outputs, Outputs, _Variant]]:
        """(reference outputs, variant outputs, variant). Batched: the example rides along as
        copy 0 of every forward and is the reference, so both came from the same call."""
        if not batched:
            for v in variants:
                yield self.base, self.forward(v.x), v
            return
        per = max(1, MAX_ROWS // self.b - 1)
        for i in range(0, len(variants), per):
            chunk = variants[i : i + per]
            out = self.forward(torch.cat([self.x] + [v.x for v in chunk]))
            ref = out.rows(0, self.b)
            for j, v in enumerate(chunk):
                yield ref, out.rows((j + 1) * self.b, (j + 2) * self.b), v

    def _compare_all(self, name: str, variants: list[_Variant]) -> ProbeResult:
        tally = _Tally(name, self.mode, self.t)
        for ref, out, v in self._outputs_of(variants, self.batchable):
            tally.add(*_changes(ref, out, v.upto, self.exact_ok), self.tol)
        return tally.result(self.tol)

    def _with_future(self, cut: int, future: Tensor) -> _Variant:
        x = self.x.clone()
        x[:, cut + 1 :] = future
        return _Variant(x, cut + 1)

    # -- probe 1 ----------------------------------------------------------------------------
    def _random_variants(self) -> list[_Variant]:
        shape = tuple(self.x.shape)
        return [
            self._with_future(c, self.sampler.draw((self.b, self.t - c - 1, *shape[2:]), self.gen))
            for _ in range(self.trials)
            for c in self.cuts
        ]

    # -- probe 2 ----------------------------------------------------------------------------
    def _adversarial_variants(self) -> list[_Variant]:
        variants = []
        cuts = _spread(self.cuts, ADVERSARIAL_CUTS)
        search = not self.sampler.tokens and not self._gates() and self._differentiable()
        for c in cuts:
            futures = self._floods(self.x[:, : c + 1], self.t - c - 1)
            if search and c in _spread(cuts, GRADIENT_CUTS):
                futures += self._gradient_floods(c)
            variants += [self._with_future(c, f) for f in futures]
        return variants

    def _gates(self) -> list[Tensor]:
        return self.at.gate_vectors(self.x.shape[-1]) if self.x.dim() == 3 and not self.sampler.tokens else []

    def _floods(self, past: Tensor, r: int) -> list[Tensor]:
        """Blocks of r future positions [B', R, ...] competing with / leaving the experts of `past`:
        scaled copies of the past in turn, every future position a scaled copy of one earlier
        position (for a few of them), and floods along the gate vectors of input-reading routers."""
        if self.sampler.tokens:
            return self._token_floods(past, r)
        b = past.shape[0]
        out = [self._copies(past, r, s) for s in (FLOOD_SCALE, -FLOOD_SCALE)]
        for p in _spread(list(range(past.shape[1])), MAX_EXPERTS_FLOODED):
            one = past[:, p : p + 1].expand(b, r, *past.shape[2:])
            out += [FLOOD_SCALE * one, -FLOOD_SCALE * one]
        for gate_ED in self._gates():
            out += self._gate_floods(past, r, gate_ED)
        return out

    @staticmethod
    def _copies(past: Tensor, r: int, scale: float) -> Tensor:
        """Position j of the future = scale * past position (j mod len(past))."""
        idx = torch.arange(r, device=past.device) % past.shape[1]
        return past[:, idx] * scale if past.is_floating_point() else past[:, idx]

    def _gate_floods(self, past: Tensor, r: int, gate_ED: Tensor) -> list[Tensor]:
        """Future positions along one router's gate vectors: every position on the favourite
        expert of each earlier position in turn (mixed), and per expert earlier positions use
        most, all on it (flood) or all away from it (drain)."""
        u_ED = (gate_ED / gate_ED.norm(dim=1, keepdim=True).clamp_min(1e-12)).to(past.dtype)
        norm = float(self.x.detach().double().norm(dim=-1).mean())
        mag = FLOOD_SCALE * (norm if norm > 0 else 1.0)
        logits_BSE = past.detach() @ u_ED.T
        top_BS = logits_BSE.argmax(-1)
        idx = torch.arange(r, device=past.device) % past.shape[1]

        def noise() -> Tensor:  # breaks ties between flooding positions
            return 0.05 * mag * torch.randn((past.shape[0], r, u_ED.shape[1]), generator=self.gen).to(past)

        out = [mag * u_ED[top_BS[:, idx]] + noise()]
        k = min(MAX_EXPERTS_FLOODED, u_ED.shape[0])
        counts_E = torch.bincount(logits_BSE.topk(min(2, u_ED.shape[0]), dim=-1).indices.flatten(), minlength=u_ED.shape[0])
        for e in counts_E.topk(k).indices.tolist():
            out.append(mag * u_ED[e].expand(past.shape[0], r, -1) + noise())
            out.append(-mag * u_ED[e].expand(past.shape[0], r, -1) + noise())
        return out

    def _differentiable(self) -> bool:
        if self._is_differentiable is None:
            self._is_differentiable = self.forward_with_grad(self.x) is not None
        return self._is_differentiable

    def _gradient_floods(self, cut: int) -> list[Tensor]:
        """Signed-gradient search over the future positions, for opaque differentiable targets:
        push their outputs along (flood) or against (drain) the mean output of positions <= cut,
        and along each of the output features those positions use most (for a router's dense
        weights: each expert the earlier tokens chose)."""
        u_BF = self.base.value_BTF[:, : cut + 1].mean(1)
        directions = [u_BF]
        for f in u_BF.abs().sum(0).topk(min(MAX_EXPERTS_FLOODED // 2, u_BF.shape[1])).indices.tolist():
            d_BF = torch.zeros_like(u_BF)
            d_BF[:, f] = u_BF[:, f].sign()
            directions.append(d_BF)
        out = []
        for d_BF in directions:
            for sign in (1.0, -1.0):
                x = self.x.detach().clone()
                for _ in range(GRADIENT_STEPS):
                    value_BTF, wrt = self.forward_with_grad(x)
                    objective = sign * (value_BTF[:, cut + 1 :] * d_BF[:, None].to(value_BTF)).sum()
                    (grad,) = torch.autograd.grad(objective, wrt, allow_unused=True)
                    if grad is None:
                        break
                    x[:, cut + 1 :] = (x[:, cut + 1 :] + self.sampler.std * grad[:, cut + 1 :].sign()).detach()
                out.append(x[:, cut + 1 :])
        return out

    def _token_floods(self, past: Tensor, r: int) -> list[Tensor]:
        b = past.shape[0]
        out = [self._copies(past, r, 1.0), past[:, -1:].expand(b, r), past[:, :1].expand(b, r)]
        out += [torch.full((b, r), i, dtype=past.dtype, device=past.device) for i in self._flood_ids()]
        return out

    def _flood_ids(self) -> list[int]:
        """Token ids that, repeated, each router scores highest (flood) and lowest (drain) per
        expert; found with one forward over sequences of a single repeated id."""
        if self._ids is not None:
            return self._ids
        self._ids = []
        if not self.at.routers:
            return self._ids
        v = self.sampler.vocab_size
        ids = torch.arange(v) if v <= MAX_ROWS else torch.randperm(v, generator=self.gen)[:MAX_ROWS]
        seq = ids.to(self.x.device, self.x.dtype)[:, None].expand(-1, min(self.t, 8))
        logits: list[Tensor] = []
        hooks = [r.gate.register_forward_hook(lambda _m, _i, o: logits.append(o.detach())) for r in self.at.routers]
        try:
            self.forward(seq)
        except (RuntimeError, ValueError):
            return self._ids  # a target that cannot take this batch shape: no ranked ids
        finally:
            for h in hooks:
                h.remove()
        chosen: list[int] = []
        for lg in logits:
            probs = lg.float().softmax(-1).reshape(ids.numel(), -1, lg.shape[-1]).mean(1)
            chosen += ids[probs.argmax(0)].tolist() + ids[probs.argmin(0)].tolist()
        self._ids = list(dict.fromkeys(chosen))[: 2 * MAX_EXPERTS_FLOODED]
        return self._ids

    # -- probe 3 ----------------------------------------------------------------------------
    def _jacobian_probe(self) -> ProbeResult | None:
        res = self.forward_with_grad(self.x)
        if res is None:
            return None
        value_BTF, wrt = res
        future, own = [], []
        for s in self.cuts:
            # Random signs: sum_f w_f d out[s, f] / d in[r] cannot cancel for every draw, and equals
            # the Jacobian entry itself where each input feature moves a single output feature.
            w = torch.randint(0, 2, value_BTF[:, s].shape, generator=self.gen).to(value_BTF) * 2 - 1
            (g,) = torch.autograd.grad((value_BTF[:, s] * w).sum(), wrt, retain_graph=True, allow_unused=True)
            g = torch.zeros_like(wrt) if g is None else g.detach().double().abs().nan_to_num(nan=math.inf)
            future.append(float(g[:, s + 1 :].amax()) if g[:, s + 1 :].numel() else 0.0)
            own.append(float(g[:, : s + 1].amax()))
        ref = max(own)
        tol = torch.finfo(value_BTF.dtype).eps * ref
        tally = _Tally("jacobian", self.mode, self.t)
        for s, f in zip(self.cuts, future):
            tally.delta_T[s] = f
            tally.moved_T[s] = f > tol
            tally.probed_T[s] = True
            tally.comparisons += 1
        return tally.result(tol)

    # -- probe 4 ----------------------------------------------------------------------------
    def _batch_probe(self) -> ProbeResult:
        """Sample 0 against the same sample among other samples: resampled, flooding its
        experts, scaled copies of it, or absent (B = 1)."""
        tally = _Tally(BATCH_PROBE, self.mode, self.t)
        gen = torch.Generator().manual_seed(self.seed + 1)
        others = max(self.b, 2) - 1
        shape = (others, *self.x.shape[1:])
        blocks = [self.sampler.draw(shape, gen) for _ in range(self.trials)]
        x0 = self.x[:1]
        if self.sampler.tokens:
            blocks += [x0.expand(shape)]
            blocks += [torch.full(shape, i, dtype=x0.dtype, device=x0.device) for i in self._flood_ids()]
        else:
            blocks += [(x0 * s).expand(shape) for s in (1.0, FLOOD_SCALE, -FLOOD_SCALE)]
            for gate_ED in self._gates():
                blocks += [f[:1].expand(shape) for f in self._gate_floods(x0, self.t, gate_ED)]
        variants = [_Variant(torch.cat([x0, blk]), self.t) for blk in blocks]
        if self.b > 1:
            variants.append(_Variant(x0, self.t))
        for v in variants:
            tally.add(*_changes(self.base, self.forward(v.x), self.t, self.exact_ok, sample=slice(0, 1)), self.tol)
        return tally.result(self.tol)

    # -- probe 5 ----------------------------------------------------------------------------
    def _decode_probe(self) -> ProbeResult:
        tally = _Tally(DECODE_PROBE, self.mode, self.t)
        for c in self.cuts:
            tally.add(*_changes(self.base, self.forward(self.x[:, : c + 1]), c + 1, self.exact_ok), self.tol)
        return tally.result(self.tol)
