"""What a probe is given: the example, fresh positions to draw, the cut positions, seeded
generators, and a few facts about the target found once per mode (its gate vectors, the token
ids its routers favour, positions that route differently).

Shape legend: B batch, T sequence, D input features per position, F output features per
position, R future positions (T - t - 1).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property

import torch
from torch import Tensor

from moe.audit.comparator import Variant, spread
from moe.audit.packing import MAX_ROWS
from moe.audit.runner import Runner, TargetFailure, TargetTimeout
from moe.audit.target import AuditTarget, AuditUsageError, Outputs

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
