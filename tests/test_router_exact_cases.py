"""Exact cases of router rules that the hand cases elsewhere leave open, each against a slow,
obviously correct float64 reference written here: expert threshold's group statistic with a
capacity above 1 and its histogram quantile, quantile balancing's target load when N*K does not
divide by E, token rounding up of a count already a tile multiple, the prefix pool's first m
tokens, replayed empty slots in a softmax over slots, the predictor's detached input, and the
gate's gradient through expert choice's and expert threshold's combine weights."""

from __future__ import annotations

import pytest
import torch
from helpers import assignments as pairs
from helpers import identity_router, routed_weights

import moe
from moe.routers.ec_threshold import population_cutoff


# -- ec_threshold: the group statistic is the C-th best score of each group, C >= 2 -------------------
@pytest.mark.parametrize(
    ("num_experts", "seq_len", "capacity_factor", "group"),
    [(2, 8, 1.0, "sequence"), (4, 6, 2.0, "batch")],  # C = ceil(cf * S / E) = 4, and 6 (S = 2 * 6)
)
def test_ec_threshold_group_statistic_is_the_mean_cth_best_score(num_experts, seq_len, capacity_factor, group):
    """After each training step's update the threshold is the bias-corrected EMA (from sum 0 and
    weight 0) of the mean over the step's groups of each expert's C-th largest score, C >= 2:
    not its best score. Reference: torch.sort of the float64 softmax, the EMA written out."""
    gen = torch.Generator().manual_seed(11)
    e, b, momentum = num_experts, 2, 0.9
    r = identity_router("ec_threshold", e, capacity_factor=capacity_factor, group=group, momentum=momentum).train()
    s = seq_len if group == "sequence" else b * seq_len
    c = -(-int(capacity_factor * s) // e)
    assert c >= 2
    ema_sum, ema_weight = torch.zeros(e, dtype=torch.float64), 0.0
    for _ in range(2):
        x = torch.randn(b, seq_len, e, generator=gen, dtype=torch.float64)
        r(x)
        r.update_after_step()
        probs_GSE = torch.softmax(x, -1).reshape(-1, s, e)
        cth_GE = torch.sort(probs_GSE, dim=1, descending=True).values[:, c - 1, :]
        ema_sum = momentum * ema_sum + (1 - momentum) * cth_GE.mean(0)
        ema_weight = momentum * ema_weight + (1 - momentum)
        torch.testing.assert_close(r.threshold, ema_sum / ema_weight, rtol=0, atol=1e-12)


# -- ec_threshold: the population statistic's histogram quantile ----------------------------------
def slow_population_cutoff(hist_EB: torch.Tensor, fraction: float) -> list[float]:
    """Per expert, scanning the bins from the top: the first bin where the count so far reaches
    fraction * total, and the cut-off inside it with the bin's tokens spread evenly over
    [j/B, (j+1)/B): (j+1)/B minus the share of the bin still needed, times 1/B."""
    out = []
    for row in hist_EB.tolist():
        bins, want, above = len(row), fraction * sum(row), 0.0
        cut = 0.0
        for j in reversed(range(bins)):
            if row[j] > 0 and above + row[j] >= want:
                cut = (j + 1 - (want - above) / row[j]) / bins
                break
            above += row[j]
        out.append(cut)
    return out


def test_population_cutoff_interpolates_inside_its_bin():
    """The cut-off is read inside the bin that reaches the wanted count, from the bin's top: a hand
    case (bins of 1/4; counts 1, 1, 4, 2 from the lowest; the best 3 of 8 are the 2 of the top bin
    and the best quarter of the 4 in [0.5, 0.75): 0.75 - 0.25 / 4) and random histograms, each to
    1e-9 of the slow per-bin loop (the bin's bottom plus the share instead is off by a fraction
    of a bin width)."""
    hand = torch.tensor([[1.0, 1.0, 4.0, 2.0]], dtype=torch.float64)
    assert population_cutoff(hand, 3 / 8).item() == pytest.approx(0.6875, abs=1e-12)
    assert slow_population_cutoff(hand, 3 / 8) == pytest.approx([0.6875], abs=1e-12)
    gen = torch.Generator().manual_seed(5)
    for bins, fraction in [(16, 0.25), (16, 0.3), (64, 0.125), (7, 0.55)]:
        hist = torch.randint(0, 9, (3, bins), generator=gen).double()
        hist[:, -1] = 1.0  # nonempty rows
        got = population_cutoff(hist, fraction)
        assert got.tolist() == pytest.approx(slow_population_cutoff(hist, fraction), abs=1e-9)


def test_population_threshold_after_one_step_is_the_histogram_quantile():
    """Through the router: after one training step the population threshold is the slow quantile
    of the histogram of the step's scores (bins over [0, 1]), fraction cf / E."""
    gen = torch.Generator().manual_seed(6)
    bins, e = 32, 4
    r = identity_router("ec_threshold", e, statistic="population", capacity_factor=1.0, population_bins=bins)
    x = torch.randn(3, 10, e, generator=gen, dtype=torch.float64)
    r.train()(x)
    r.update_after_step()
    probs_NE = torch.softmax(x.reshape(-1, e), -1)
    hist = torch.zeros(e, bins, dtype=torch.float64)
    for n in range(probs_NE.shape[0]):
        for j in range(e):
            hist[j, min(int(probs_NE[n, j] * bins), bins - 1)] += 1
    want = slow_population_cutoff(hist, 1.0 / e)
    assert r.threshold.tolist() == pytest.approx(want, abs=1e-9)


# -- quantile: the target load C = N*K // E when N*K does not divide by E -----------------------------
def test_quantile_bias_uses_the_floor_of_the_target_load():
    """N = 9 tokens, K = 2, E = 4: the target load is C = floor(18 / 4) = 4, so a training forward
    records per expert the (C+1) = 5th largest of ``logits - alpha`` (alpha: each token's (K+1)-th
    best logit; beta starts at 0), and the update sets beta to it re-centred to mean 0.
    Reference: float64 sorts of the float32 scores the router reads."""
    gen = torch.Generator().manual_seed(7)
    n, k, e = 9, 2, 4
    r = identity_router("quantile", e, top_k=k).train()
    x = torch.randn(1, n, e, generator=gen, dtype=torch.float64)
    r(x)
    scores_NE = x.reshape(n, e).float().double()
    alpha_N1 = torch.sort(scores_NE, -1, descending=True).values[:, k : k + 1]
    c = (n * k) // e
    assert c == 4
    want_E = torch.sort(scores_NE - alpha_N1, 0, descending=True).values[c]
    torch.testing.assert_close(r.pending_beta.double(), want_E, rtol=0, atol=1e-6)
    r.update_after_step()
    torch.testing.assert_close(r.beta.double(), want_E - want_E.mean(), rtol=0, atol=1e-6)


# -- token_rounding: rounding up leaves a count that is already a tile multiple -----------------------
def rounded_up(count: int, tile: int) -> int:
    """The least multiple of ``tile`` that is at least ``count``, by counting up."""
    r = 0
    while r < count:
        r += tile
    return r


def rounded_up_reference(logits_NE: torch.Tensor, tile: int) -> dict[tuple[int, int], float]:
    """{(token, expert): weight} of top-1 token rounding up, one expert at a time: each expert
    keeps its choosers (weight 1) and tops up with the best-scored others (at their softmax)."""
    probs = torch.softmax(logits_NE, -1).tolist()
    n, e = len(probs), len(probs[0])
    pick = [max(range(e), key=lambda j: (probs[i][j], -j)) for i in range(n)]
    kept = {}
    for j in range(e):
        chosen = [i for i in range(n) if pick[i] == j]
        others = sorted((i for i in range(n) if pick[i] != j), key=lambda i: (-probs[i][j], i))
        for i in (chosen + others)[: min(rounded_up(len(chosen), tile), n)]:
            kept[(i, j)] = 1.0 if pick[i] == j else probs[i][j]
    return kept


def test_token_rounding_up_keeps_a_count_already_a_tile_multiple():
    """Top-1 over 2 experts, tiles of 2: expert 0 is chosen by 4 tokens, expert 1 by 2, both
    multiples of the tile, so rounding up adds nothing (the routing is plain top-1); a third case
    has counts 3 and 3, each rounded up to 4. Pairs exact, weights to 1e-12 of the reference."""
    x = torch.tensor(
        [[2.0, 0.0], [1.0, 0.0], [0.5, 0.0], [0.3, 0.0], [0.0, 1.0], [0.0, 2.0]], dtype=torch.float64
    ).view(1, 6, 2)
    r = identity_router("token_rounding", 2, top_k=1, tile_size=2, rounding="up").train()
    got = r(x)
    assert pairs(got) == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 1), (5, 1)]
    assert got.stats["rounded_in"].item() == 0.0
    gen = torch.Generator().manual_seed(8)
    for tile, counts in [(2, (4, 2)), (3, (3, 3))]:
        rows = []
        for j, count in enumerate(counts):
            for _ in range(count):
                row = 0.5 * torch.randn(2, generator=gen, dtype=torch.float64)
                row[j] += 2.0
                rows.append(row)
        x = torch.stack(rows).view(1, -1, 2)
        assert torch.bincount(x.argmax(-1).view(-1), minlength=2).tolist() == list(counts)
        r = identity_router("token_rounding", 2, top_k=1, tile_size=tile, rounding="up").train()
        got, want = routed_weights(r(x)), rounded_up_reference(x.view(-1, 2), tile)
        assert set(got) == set(want)
        assert max(abs(got[p] - want[p]) for p in want) < 1e-12


# -- doc_pool: the prefix pool reads a document's first m tokens only ---------------------------------
EOS = 9


def prefix_pool_reference(logits_TE: torch.Tensor, ids_T: list[int], pool: int, k: int, m: int) -> dict:
    """{(t, expert): weight}, one token at a time, as the module docstring says: token t's pool is
    the ``pool`` experts of largest summed softmax over its document's positions 0..min(i, m-1)
    (ties: the lower index); it takes its top-k of the softmax over the pool's logits alone,
    weights renormalised over the k."""
    probs = torch.softmax(logits_TE, -1).tolist()
    t_len, e = len(probs), len(probs[0])
    out, start = {}, 0
    for t in range(t_len):
        if t > 0 and ids_T[t - 1] == EOS:
            start = t
        read = range(start, min(t, start + m - 1) + 1)
        sums = [sum(probs[s][j] for s in read) for j in range(e)]
        members = sorted(range(e), key=lambda j: (-sums[j], j))[:pool]
        z = sum(torch.tensor(float(logits_TE[t, j])).exp().item() for j in members)
        score = {j: torch.tensor(float(logits_TE[t, j])).exp().item() / z for j in members}
        top = sorted(members, key=lambda j: (-score[j], j))[:k]
        mass = sum(score[j] for j in top)
        for j in top:
            out[(t, j)] = score[j] / mass
    return out


def test_prefix_pool_reads_the_first_m_tokens_of_each_document_only():
    """m = 2, P = 2 of E = 4, top-1: each document's first two tokens favour experts 0 and 1, its
    third (position m) puts almost all its mass on expert 3, and the later tokens favour expert 3
    too. Their pool must be {0, 1} (positions 0..m-1), not one holding expert 3 (position m read
    as well). Two documents (an EOS id ends the first); pairs exact, weights to 1e-12."""
    gen = torch.Generator().manual_seed(9)
    e, t_len = 4, 14
    logits = 0.3 * torch.randn(t_len, e, generator=gen, dtype=torch.float64)
    ids = [1] * t_len
    ids[6] = EOS  # document 0: positions 0..6, document 1: positions 7..13
    for start in (0, 7):
        logits[start, :2] += torch.tensor([2.2, 2.0], dtype=torch.float64)
        logits[start + 1, :2] += torch.tensor([2.0, 2.2], dtype=torch.float64)
        logits[start + 2, 3] += 10.0
        logits[start + 3 : start + 7, 3] += 1.5
    r = identity_router(
        "doc_pool", e, document_expert_pool=2, top_k=1, pool_from="prefix", pool_prefix=2, eos_token_id=EOS
    ).train()
    got = routed_weights(r(logits.view(1, t_len, e), token_ids_BT=torch.tensor([ids])))
    want = prefix_pool_reference(logits, ids, pool=2, k=1, m=2)
    assert all(j in (0, 1) for _, j in want)  # the reference's pools: experts 0 and 1 throughout
    assert set(got) == set(want)
    assert max(abs(got[p] - want[p]) for p in want) < 1e-12


# -- replay: a softmax over the slots ignores empty slots ---------------------------------------------
@pytest.mark.parametrize(
    ("name", "options"),
    [("quantile", {"top_k": 2}), ("topk", {"top_k": 2, "pre_softmax": False, "normalize": False})],
)
def test_replayed_empty_slot_is_outside_the_slot_softmax(name, options):
    """A replayed record with empty (-1) slots: each filled slot's weight is the float64 softmax
    over the filled slots' logits alone (a lone filled slot weighs 1), the empty slot gets no row
    (and no weight on expert 0, which the empty slot's clamped index would read). Top-k is
    taken without renormalisation: dividing by the slots' sum would hide a denominator that
    counted the empty slot."""
    gen = torch.Generator().manual_seed(10)
    e = 4
    r = identity_router(name, e, **options).train()
    x = torch.randn(1, 4, e, generator=gen, dtype=torch.float64)
    expert_NK = torch.tensor([[2, -1], [1, 3], [-1, 3], [2, 0]])
    routing = r.replay(r.score_logits(x.view(4, e)), x, (1, 4), expert_NK, decoding=False)
    got = routed_weights(routing)
    want = {}
    for n, slots in enumerate(expert_NK.tolist()):
        filled = [j for j in slots if j >= 0]
        z = sum(x[0, n, j].exp().item() for j in filled)
        want.update({(n, j): x[0, n, j].exp().item() / z for j in filled})
    assert set(got) == set(want)
    assert max(abs(got[p] - want[p]) for p in want) < 1e-12
    assert got[(0, 2)] == pytest.approx(1.0, abs=1e-15) and got[(2, 3)] == pytest.approx(1.0, abs=1e-15)
    assert routing.dense()[0, 0, 0].item() == 0.0 and routing.dense()[0, 2, 0].item() == 0.0


# -- ec_predictor: the predictor's loss does not reach the trunk --------------------------------------
def test_ec_predictor_loss_does_not_reach_the_input():
    """Training mode, z-loss off: the aux loss is the predictor's BCE alone, computed on a detached
    input, so its backward leaves the input without gradient while the predictor learns."""
    gen = torch.Generator().manual_seed(12)
    r = moe.build_router("ec_predictor", d_model=8, num_experts=4, capacity_factor=1.0, z_loss_coef=0.0)
    r = r.double().train()
    x = torch.randn(2, 6, 8, generator=gen, dtype=torch.float64).requires_grad_()
    r(x).aux_loss.backward()
    leaked = 0.0 if x.grad is None else x.grad.abs().max().item()
    assert leaked == 0.0, f"the predictor's loss reaches the input: max |dL/dx| = {leaked:.3g}"
    assert r.predictor.weight.grad is not None and r.predictor.weight.grad.abs().max().item() > 0


# -- the gate's gradient through the combine weights ----------------------------------------------
@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("expert_choice", {"capacity_factor": 1.0}),
        ("ec_threshold", {"capacity_factor": 1.0}),
        ("topk", {"top_k": 2}),  # control: weights renormalised over the token's two experts
    ],
)
def test_combine_weights_carry_the_gate_gradient(name, options):
    """The gate weight's gradient of sum(weight * r) (r random per assignment) equals that of an
    independent float64 recomputation of the same weights, softmax(x W^T)[token, expert] by hand
    (renormalised over the token's experts for top-k), at the routing's own pairs."""
    gen = torch.Generator().manual_seed(13)
    d, e = 6, 4
    r = moe.build_router(name, d_model=d, num_experts=e, **options).double().train()
    with torch.no_grad():
        r.gate.weight.copy_(torch.randn(e, d, generator=gen, dtype=torch.float64))
    x = torch.randn(2, 5, d, generator=gen, dtype=torch.float64)
    routing = r(x)
    assert routing.token.numel() > 0
    coef_A = torch.randn(routing.token.numel(), generator=gen, dtype=torch.float64)
    (grad,) = torch.autograd.grad((routing.weight * coef_A).sum(), r.gate.weight)

    w = r.gate.weight.detach().clone().requires_grad_()
    logits = x.reshape(-1, d) @ w.T
    expo = (logits - logits.max(-1, keepdim=True).values.detach()).exp()
    probs = expo / expo.sum(-1, keepdim=True)
    token, expert = routing.token, routing.expert
    weight = probs[token, expert]
    if name == "topk":
        mass = torch.zeros(probs.shape[0], dtype=torch.float64).index_add(0, token, weight)
        weight = weight / (mass[token] + 1e-20)
    torch.testing.assert_close(routing.weight.detach(), weight.detach(), rtol=0, atol=1e-12)
    (want,) = torch.autograd.grad((weight * coef_A).sum(), w)
    assert want.abs().max() > 1e-3
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-12)
