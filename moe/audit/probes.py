"""The probes: generators of input variants, each compared with the example by the comparator.

Shape legend: B batch, T sequence, D input features per position, F output features per
position, E experts, R future positions (T - t - 1).

1. ``random_future``: resample positions > t, for every cut t (0 and T-2 included, up to 16 cuts).
2. ``adversarial_future``: future positions built to compete for the experts that earlier tokens
   use (flooding) or to leave them (draining). With routers that read the input, along their
   gate vectors; always with scaled copies of earlier positions (token ids: copied earlier
   tokens, and the ids each router scores highest / lowest per expert); for an opaque,
   differentiable float target, by a few steps of signed-gradient search. Random perturbations
   rarely move a token across a top-k or capacity cut-off: this probe covers that blind spot.
3. ``jacobian``: |d output[s] / d input[> s]| for every probed s (continuous leaks, e.g. statistics
   over the sequence; blind to discrete ones). Computes gradients instead of comparing variants.
4. ``batch_interference``: resample or flood the *other* samples, or run the sample alone; does
   the probed sample's output move? Reported as ``batch_invariant``, not as a future leak.
5. ``decode_consistency``: the output at positions <= t from the prefix 0..t alone against the
   full-sequence output, for every prefix length the target accepts (the others are reported
   as skipped).
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Iterator

import torch
from torch import Tensor

from moe.audit.comparator import MAX_ROWS, Variant, spread
from moe.audit.report import ProbeResult
from moe.audit.runner import Runner, TargetFailure
from moe.audit.target import AuditTarget, AuditUsageError

MAX_CUTS = 16
"""Most cut positions t probed per sequence (all of 0..T-2 when T <= 17)."""
ADVERSARIAL_CUTS = 5
"""Cut positions for the adversarial probe (spread over 0..T-2, ends included)."""
MAX_EXPERTS_FLOODED = 4
"""Experts flooded / drained per router and cut: the ones earlier tokens use most."""
FLOOD_SCALE = 3.0
"""Flooding inputs have this many times the mean norm of an input position."""
GRADIENT_STEPS = 3
"""Signed-gradient steps of the search for opaque targets."""
GRADIENT_CUTS = 3
"""Cut positions (of the adversarial ones) where opaque targets get the gradient search."""


class Sampler:
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


class Probes:
    """The variants of every probe for one example, target and seed (the same in every mode,
    so train and eval are probed with the same inputs)."""

    def __init__(self, at: AuditTarget, runner: Runner, x: Tensor, sampler: Sampler, trials: int, seed: int) -> None:
        self.at, self.runner, self.x, self.sampler, self.trials, self.seed = at, runner, x, sampler, trials, seed
        self.b, self.t = x.shape[0], x.shape[1]
        self.cuts = spread(list(range(self.t - 1)), MAX_CUTS)

    def _gen(self, salt: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1000 + salt)

    def _with_future(self, cut: int, future: Tensor) -> Variant:
        x = self.x.clone()
        x[:, cut + 1 :] = future
        return Variant(x, cut + 1)

    # -- probe 1 ----------------------------------------------------------------------------
    def random_future(self) -> Iterator[Variant]:
        gen = self._gen(1)
        shape = tuple(self.x.shape)
        for _ in range(self.trials):
            for c in self.cuts:
                yield self._with_future(c, self.sampler.draw((self.b, self.t - c - 1, *shape[2:]), gen))

    def calibration_inputs(self, n: int = 2) -> list[Tensor]:
        """A few inputs of the example's shape with every position after the first resampled:
        the comparator checks that a stochastic target draws the same noise shapes for them."""
        gen = self._gen(2)
        return [self._with_future(0, self.sampler.draw((self.b, self.t - 1, *self.x.shape[2:]), gen)).x for _ in range(n)]

    # -- probe 2 ----------------------------------------------------------------------------
    def adversarial_future(self, base_value_BTF: Tensor | None) -> Iterator[Variant]:
        gen = self._gen(3)
        cuts = spread(self.cuts, ADVERSARIAL_CUTS)
        search = not self.sampler.tokens and not self._gates and base_value_BTF is not None and self._differentiable
        for c in cuts:
            futures = self._floods(self.x[:, : c + 1], self.t - c - 1, gen)
            if search and c in spread(cuts, GRADIENT_CUTS):
                futures += self._gradient_floods(c, base_value_BTF)
            for f in futures:
                yield self._with_future(c, f)

    @cached_property
    def _gates(self) -> list[Tensor]:
        return self.at.gate_vectors(self.x.shape[-1]) if self.x.dim() == 3 and not self.sampler.tokens else []

    def _floods(self, past: Tensor, r: int, gen: torch.Generator) -> list[Tensor]:
        """Blocks of r future positions [B', R, ...] competing with / leaving the experts of `past`:
        scaled copies of the past in turn, every future position a scaled copy of one earlier
        position (for a few of them), and floods along the gate vectors of input-reading routers."""
        if self.sampler.tokens:
            return self._token_floods(past, r)
        b = past.shape[0]
        out = [self._copies(past, r, s) for s in (FLOOD_SCALE, -FLOOD_SCALE)]
        for p in spread(list(range(past.shape[1])), MAX_EXPERTS_FLOODED):
            one = past[:, p : p + 1].expand(b, r, *past.shape[2:])
            out += [FLOOD_SCALE * one, -FLOOD_SCALE * one]
        for gate_ED in self._gates:
            out += self._gate_floods(past, r, gate_ED, gen)
        return out

    @staticmethod
    def _copies(past: Tensor, r: int, scale: float) -> Tensor:
        """Position j of the future = scale * past position (j mod len(past))."""
        idx = torch.arange(r, device=past.device) % past.shape[1]
        return past[:, idx] * scale if past.is_floating_point() else past[:, idx]

    def _gate_floods(self, past: Tensor, r: int, gate_ED: Tensor, gen: torch.Generator) -> list[Tensor]:
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
            return 0.05 * mag * torch.randn((past.shape[0], r, u_ED.shape[1]), generator=gen).to(past)

        out = [mag * u_ED[top_BS[:, idx]] + noise()]
        k = min(MAX_EXPERTS_FLOODED, u_ED.shape[0])
        counts_E = torch.bincount(logits_BSE.topk(min(2, u_ED.shape[0]), dim=-1).indices.flatten(), minlength=u_ED.shape[0])
        for e in counts_E.topk(k).indices.tolist():
            out.append(mag * u_ED[e].expand(past.shape[0], r, -1) + noise())
            out.append(-mag * u_ED[e].expand(past.shape[0], r, -1) + noise())
        return out

    @cached_property
    def _differentiable(self) -> bool:
        try:
            return self.runner.forward_with_grad(self.x) is not None
        except TargetFailure:
            return False

    def _gradient_floods(self, cut: int, base_value_BTF: Tensor) -> list[Tensor]:
        """Signed-gradient search over the future positions, for opaque differentiable targets:
        push their outputs along (flood) or against (drain) the mean output of positions <= cut,
        and along each of the output features those positions use most (for a router's dense
        weights: each expert the earlier tokens chose)."""
        u_BF = base_value_BTF[:, : cut + 1].nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).mean(1)
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
                    try:
                        value_BTF, wrt = self.runner.forward_with_grad(x)
                    except TargetFailure:
                        break
                    objective = sign * (value_BTF[:, cut + 1 :].nan_to_num(0.0, 0.0, 0.0) * d_BF[:, None].to(value_BTF)).sum()
                    try:
                        (grad,) = torch.autograd.grad(objective, wrt, allow_unused=True)
                    except RuntimeError:  # the target's graph cannot be differentiated after all
                        break
                    if grad is None:
                        break
                    x[:, cut + 1 :] = (x[:, cut + 1 :] + self.sampler.std * grad[:, cut + 1 :].sign()).detach()
                out.append(x[:, cut + 1 :])
        return out

    def _token_floods(self, past: Tensor, r: int) -> list[Tensor]:
        b = past.shape[0]
        out = [self._copies(past, r, 1.0), past[:, -1:].expand(b, r), past[:, :1].expand(b, r)]
        out += [torch.full((b, r), i, dtype=past.dtype, device=past.device) for i in self._flood_ids]
        return out

    @cached_property
    def _flood_ids(self) -> list[int]:
        """Token ids that, repeated, each router scores highest (flood) and lowest (drain) per
        expert; found with one forward over sequences of a single repeated id."""
        if not self.at.routers:
            return []
        v = self.sampler.vocab_size
        ids = torch.arange(v) if v <= MAX_ROWS else torch.randperm(v, generator=self._gen(4))[:MAX_ROWS]
        seq = ids.to(self.x.device, self.x.dtype)[:, None].expand(-1, min(self.t, 8))
        logits: list[Tensor] = []
        hooks = [r.gate.register_forward_hook(lambda _m, _i, o: logits.append(o.detach())) for r in self.at.routers]
        try:
            self.runner.forward(seq)
        except TargetFailure:
            return []  # a target that cannot take this batch shape: no ranked ids
        finally:
            for h in hooks:
                h.remove()
        chosen: list[int] = []
        for lg in logits:
            probs = lg.float().cpu().softmax(-1).reshape(ids.numel(), -1, lg.shape[-1]).mean(1)
            chosen += ids[probs.argmax(0)].tolist() + ids[probs.argmin(0)].tolist()
        return list(dict.fromkeys(chosen))[: 2 * MAX_EXPERTS_FLOODED]

    # -- probe 3 ----------------------------------------------------------------------------
    def jacobian(self, mode: str) -> ProbeResult | None:
        """None for a target that is not differentiable (or fails under autograd)."""
        try:
            res = self.runner.forward_with_grad(self.x)
        except TargetFailure:
            return None
        if res is None:
            return None
        value_BTF, wrt = res
        gen = self._gen(5)
        future, own = [], []
        for s in self.cuts:
            # Random signs: sum_f w_f d out[s, f] / d in[r] cannot cancel for every draw, and equals
            # the Jacobian entry itself where each input feature moves a single output feature.
            w = torch.randint(0, 2, value_BTF[:, s].shape, generator=gen).to(value_BTF) * 2 - 1
            row = (value_BTF[:, s] * w).nan_to_num(0.0, 0.0, 0.0).sum()  # a NaN output has no gradient to read
            try:
                (g,) = torch.autograd.grad(row, wrt, retain_graph=True, allow_unused=True)
            except RuntimeError:  # e.g. a saved tensor changed in place: not differentiable as run
                return None
            g = torch.zeros_like(wrt) if g is None else g.detach().double().abs().nan_to_num(0.0, 0.0, 0.0)
            future.append(float(g[:, s + 1 :].amax()) if g[:, s + 1 :].numel() else 0.0)
            own.append(float(g[:, : s + 1].amax()))
        tol = torch.finfo(value_BTF.dtype).eps * max(own)
        moved = [f > tol for f in future]
        first = next((s for s, m in zip(self.cuts, moved) if m), None)
        return ProbeResult(
            name="jacobian",
            mode=mode,
            leaks=first is not None,
            max_abs_delta=max(future, default=0.0),
            first_leaking_position=first,
            fraction_affected=sum(moved) / len(moved) if moved else 0.0,
            tolerance=tol if math.isfinite(tol) else 0.0,
            comparisons=len(self.cuts),
        )

    # -- probe 4 ----------------------------------------------------------------------------
    def batch_interference(self) -> Iterator[Variant]:
        """Sample 0 among other samples: resampled, flooding its experts, scaled copies of it;
        and alone (B = 1). Only sample 0's outputs are compared."""
        gen = self._gen(6)
        others = max(self.b, 2) - 1
        shape = (others, *self.x.shape[1:])
        x0 = self.x[:1]
        blocks = [self.sampler.draw(shape, gen) for _ in range(self.trials)]
        if self.sampler.tokens:
            blocks += [x0.expand(shape)]
            blocks += [torch.full(shape, i, dtype=x0.dtype, device=x0.device) for i in self._flood_ids]
        else:
            blocks += [(x0 * s).expand(shape) for s in (1.0, FLOOD_SCALE, -FLOOD_SCALE)]
            for gate_ED in self._gates:
                blocks += [f[:1].expand(shape) for f in self._gate_floods(x0, self.t, gate_ED, gen)]
        for blk in blocks:
            yield Variant(torch.cat([x0, blk]), self.t, rows=1)
        if self.b > 1:
            yield Variant(x0, self.t, rows=1)

    # -- probe 5 ----------------------------------------------------------------------------
    def decode_consistency(self) -> Iterator[Variant]:
        for c in self.cuts:
            yield Variant(self.x[:, : c + 1], c + 1)
