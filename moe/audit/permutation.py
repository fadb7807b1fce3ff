"""The distribution regime's test: do the draws of a variant come from the distribution of the
example's draws, at the outputs compared?

Shape legend: K draws (seeds) per input, B batch, S compared positions, F compared values per
position (float outputs, then exact decisions), M = B * S * F' compared elements (F' = F, or F
plus NaN / +inf / -inf indicators when some value is not finite; at most PROJECTED per position
after a random projection), P permutations.

A routing change moves a whole position's output, not one number, and noise from dropout or a
sampled expert is heavy-tailed (a kept value or a zero): a test on the largest single |z| over
thousands of elements has a null as wide as its observed value and no power at a handful of
draws. The statistic here is per position: the squared norm of the mean difference between the
variant's and the example's output vectors, each element scaled by its pooled standard deviation
over all 2K draws (at least its resolution, so rounding noise never counts), largest over
positions. Its null is the same statistic under relabellings of the draws that are exchangeable
when nothing changed; the p-value (1 + #{null >= observed}) / (1 + P) is then exact for any
output distribution (Good 2005, "Permutation, Parametric and Bootstrap Tests of Hypotheses",
ch. 3; the largest-over-positions form is Westfall and Young's max-T adjustment). Two designs:

* **independent draws** (seeds disjoint between the two inputs): any split of the 2K draws into
  two groups of K;
* **paired draws** (``paired``): draw i of both inputs under the same seed, the runner's rule
  for any two forwards it compares, used where both start from the same random op of the same
  shape, so the noise drawn before anything that follows the data (a noisy gate's Gaussian) is
  the same noise and cancels in their difference (with independent seeds, a noisy gate routes
  each token differently in every draw, and a capacity leak that moves a few tokens in most
  draws is lost in that noise). The relabellings swap the two draws within pairs (signs of the
  differences; all 2^K of them where that is at most P): under "no change" the two draws of a
  pair are exchangeable, being the same noise, or noise of one law drawn at other places of the
  stream (dropout masks whose rows follow the routing).

Relabelling stops early, with a sequential p-value, once the observed statistic is clearly
ordinary (:data:`STOP_EXCEEDANCES`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from moe.audit.compare import entry_scale

DRAWS = (8, 32, 64)
"""Draws per input at each stage: a comparison whose p-value is at most ESCALATE_P but not
significant gets the next stage's draws (more draws where the change is large); each stage is
tested at a third of the comparison's level, so the stages together keep it."""
ESCALATE_P = 0.05
"""A p-value at or below this (and not significant) buys the next stage's draws."""
INCONCLUSIVE_P = 0.01
"""After the last stage: a p-value at or below this that is not significant is INCONCLUSIVE
(a change the test could not tell from noise, nor dismiss), never "no leak"."""
PERMUTATIONS = 9999
"""Random relabellings per test: the smallest p-value, 1e-4, stays below every stage's level."""
PROJECTED = 64
"""Values per position beyond which the standardised values are randomly projected to this many
(a fixed Gaussian map, drawn before the labels are looked at: the test stays exact)."""
NULL_BUDGET = 2**24
"""Elements of the permutation null computed at once (chunks of permutations)."""
FIRST_PERMUTATIONS = 64
"""Relabellings in the first chunk; chunks double after it."""
STOP_EXCEEDANCES = 20
"""Relabellings stop once this many reached the observed statistic (the p-value is then that
count over the relabellings made, Besag and Clifford 1991, "Sequential Monte Carlo p-values",
Biometrika 78: valid, and exact enough far above any level used here): a clean target's
comparisons cost a few dozen relabellings, a leak's the full PERMUTATIONS."""
TIE = 1e-5
"""A relabelling's statistic within this relative distance below the observed one counts as a tie
(at least as extreme): float32 sums of the same values in another order differ in the last bits."""


@dataclass
class Outcome:
    """One distribution comparison."""

    p: float
    """Its permutation p-value."""
    changed_S: Tensor
    """bool [S]: positions whose own statistic exceeds the null's 1 - alpha quantile of the largest
    statistic (family-wise over positions) and whose mean moved beyond the resolution."""
    change_S: Tensor
    """float64 [S]: the largest |mean change| of a finite value at each position."""
    excess_S: Tensor
    """float64 [S]: that change over resolution x its entry's scale."""
    draws: int = 0
    """Draws per input it was decided on."""


def _indicators(values_KBSF: Tensor) -> Tensor:
    """[K, B, S, F'] values: the finite ones (0 elsewhere) and, when some is not finite, 0/1
    indicators of NaN, +inf and -inf."""
    finite = torch.isfinite(values_KBSF)
    parts = [torch.where(finite, values_KBSF, 0.0)]
    if not bool(finite.all()):
        parts += [values_KBSF.isnan().double(), (values_KBSF == math.inf).double(), (values_KBSF == -math.inf).double()]
    return torch.cat(parts, dim=-1)


def _relabel(
    statistic_PL: Callable[[Tensor], Tensor],
    observed: float,
    relabellings: Callable[[int], Tensor],
    every: Tensor | None,
    alpha: float,
    permutations: int,
    budget: int,
) -> tuple[float, float]:
    """(p, critical value of the max statistic at ``alpha``) from the relabellings of the draws:
    ``every`` one of them where they are at most ``permutations`` (the exact p-value), else
    ``relabellings(n)`` random ones, in doubling chunks of at most ``budget``, stopped early, once
    the observed value is clearly ordinary, with the sequential p of Besag and Clifford (1991) (h
    exceedances in L relabellings: p = h / L) and an infinite critical value (no position
    significant)."""
    if every is not None:
        null = torch.cat([statistic_PL(chunk).amax(1) for chunk in every.split(budget)]).sort().values
        n = null.numel()
        return int((null >= observed).sum()) / n, float(null[min(n - 1, math.ceil((1 - alpha) * n))])
    null_P: list[Tensor] = []
    done = exceed = 0
    while done < permutations:
        n = min(budget, max(FIRST_PERMUTATIONS, done), permutations - done)  # doubling chunks
        null_P.append(statistic_PL(relabellings(n)).amax(1))
        done += n
        exceed += int((null_P[-1] >= observed).sum())
        if exceed >= STOP_EXCEEDANCES:  # clearly not significant: no more relabelling
            return exceed / done, math.inf
    null = torch.cat(null_P).sort().values
    return (1.0 + exceed) / (1.0 + permutations), float(
        null[min(permutations - 1, math.ceil((1 - alpha) * permutations))]
    )


def distribution_change(
    ref_KBSF: Tensor,
    var_KBSF: Tensor,
    resolution_F: Tensor | float,
    alpha: float,
    permutations: int = PERMUTATIONS,
    gen: torch.Generator | None = None,
    rows_of: list[tuple[int, int, bool]] | None = None,
    paired: bool = False,
) -> Outcome:
    """The permutation test of the module docstring on K draws of each input.

    ``resolution_F``: per compared value (float outputs first, exact decisions after), the least
    relative change of a finite mean that counts (0 for exact decisions); a scalar applies to
    all. ``alpha``: the level at which positions are called changed. ``rows_of``: the column
    ranges of the separate outputs, and whether each is a router's weights (each entry's scale
    takes its own output's row, :func:`~moe.audit.compare.entry_scale`; None: one output).
    ``paired``: draw i of both under one seed (the module docstring's two designs)."""
    k, b, s, f = ref_KBSF.shape
    gen = gen if gen is not None else torch.Generator().manual_seed(0)
    ref, var = ref_KBSF.double(), var_KBSF.double()
    mean_ref_BSF, mean_var_BSF = ref.mean(0), var.mean(0)
    res_F = torch.as_tensor(resolution_F, dtype=torch.float64).expand(f)
    ranges = rows_of if rows_of else [(0, f, False)]
    scale_BSF = torch.cat(
        [entry_scale(mean_ref_BSF[..., a:z], mean_var_BSF[..., a:z], w) for a, z, w in ranges], dim=-1
    )
    resolution_BSF = (res_F * scale_BSF).clamp_min(torch.finfo(torch.float64).tiny)
    y_NBSG = _indicators(torch.cat([ref, var]))
    g = y_NBSG.shape[-1]
    floor_BSG = torch.cat([resolution_BSF, torch.full((b, s, g - f), 0.5, dtype=torch.float64)], dim=-1)
    y_NBSG = y_NBSG - y_NBSG.mean(0)
    sd_BSG = torch.maximum(y_NBSG.std(0), floor_BSG)
    z_NBSG = y_NBSG / sd_BSG
    if g > PROJECTED:  # a fixed random projection per position: the squared norm is kept on average
        proj_GR = torch.randn(g, PROJECTED, generator=gen, dtype=torch.float64) / math.sqrt(PROJECTED)
        z_NBSG = z_NBSG @ proj_GR
    positions = b * s
    z_NM = z_NBSG.reshape(2 * k, -1).float()
    if paired:
        d_KM = z_NM[k:] - z_NM[:k]  # pair i: the variant's draw minus the example's

        def statistic_PL(signs_PK: Tensor) -> Tensor:
            """Per sign pattern and position: the squared norm of the mean signed difference."""
            mean_PM = (signs_PK @ d_KM) / k
            return (mean_PM.reshape(signs_PK.shape[0], positions, -1) ** 2).sum(-1)

        observed_w = torch.ones(1, k)
        relabellings = lambda n: torch.randint(0, 2, (n, k), generator=gen).float() * 2 - 1  # noqa: E731
        every = ((torch.arange(2**k)[:, None] >> torch.arange(k)) & 1).float() * 2 - 1 if 2**k <= permutations else None
    else:
        total_M = z_NM.sum(0)

        def statistic_PL(group_PN: Tensor) -> Tensor:
            """Per labelling and position: the squared distance between the groups' mean vectors."""
            diff_PM = (group_PN @ z_NM) * (2.0 / k) - total_M / k  # one group's mean minus the other's
            return (diff_PM.reshape(group_PN.shape[0], positions, -1) ** 2).sum(-1)

        observed_w = (torch.arange(2 * k) >= k).float()[None]
        relabellings = lambda n: (torch.rand(n, 2 * k, generator=gen).argsort(1) < k).float()  # noqa: E731
        every = None

    # The observed labelling through the same arithmetic as the null's, so that ties (discrete
    # outputs tie often) compare equal rather than by rounding.
    observed_L = statistic_PL(observed_w)[0]
    observed = float(observed_L.max()) * (1 - TIE)
    budget = max(1, NULL_BUDGET // max(1, z_NM.shape[1]))
    p, critical = _relabel(statistic_PL, observed, relabellings, every, alpha, permutations, budget)
    significant_BS = (observed_L > critical).reshape(b, s)
    mean_change_BSF = (mean_var_BSF - mean_ref_BSF).abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    excess_BSF = mean_change_BSF / resolution_BSF
    counted_F = res_F > 0
    # A finite value changes only by more than its resolution; an exact decision or a NaN / inf
    # frequency by any amount.
    moved_BS = (excess_BSF[..., counted_F] > 1).any(-1) | (mean_change_BSF[..., ~counted_F] > 0).any(-1)
    if g > f:
        pattern_BS = (y_NBSG[:k, ..., f:].mean(0) - y_NBSG[k:, ..., f:].mean(0)).abs().amax(-1) > 0
        moved_BS = moved_BS | pattern_BS
    changed_S = (significant_BS & moved_BS).any(0)
    finite_change = torch.where(counted_F, mean_change_BSF, 0.0)
    return Outcome(
        p=p,
        changed_S=changed_S,
        change_S=finite_change.amax(dim=(0, 2)),
        excess_S=torch.where(counted_F, excess_BSF, 0.0).amax(dim=(0, 2)),
        draws=k,
    )
