"""Routing agreement: how often two execution paths of one model give a token the same experts.

Shape legend: B sequences, T positions, L MoE layers, K expert slots, E experts.

An agreement figure compares the routing of the same tokens along two paths (two
:class:`~moe.record.RoutingRecord` of them): the share of (token, layer) pairs whose expert *set*
is the same (the order of the slots and the combine weights are not compared), per layer, and
the share of tokens routed alike in every layer (R3, arXiv 2510.11370, reports that ~94% of
tokens differed in at least one layer between an inference engine and its trainer).
:func:`agreement_figures` measures the paths where serving and training part ways, all in eval
mode on the same token ids:

=========================  ============================================  ==========================================
figure                     reference path                                compared path
=========================  ============================================  ==========================================
``decode``                 full forward                                  decoding: one token at a time through the KV
                                                                         cache, or, for routers that cannot decode
                                                                         from a cache, each token in the forward of
                                                                         its own prefix
``batch``                  the B sequences in one batch                  each sequence alone
``chunked_prefill``        the prompt prefilled in one cached forward    prefilled in chunks through the cache
``bf16_router``            fp32 weights, router as configured            fp32 weights, router in bf16
``bf16_model``             fp32 weights, router as configured            bf16 weights, router in bf16 (``input``)
``bf16_model_fp32_router`` fp32 weights, router as configured            bf16 weights, router in fp32
=========================  ============================================  ==========================================

The bf16 paths run a copy of the model whose parameters are cast (buffers such as learned
thresholds keep their dtype); ``router_dtype`` is ``moe.Router``'s option. A model is any
module whose MoE layers route with this package's routers and whose forward takes token ids
(``forward(model, idx_BT)``, default ``model(idx_BT)``); the cached paths need the causal-LM
interface's ``init_cache`` / ``model(idx, cache=cache)`` / ``decode_support`` (``MoETransformer``,
``moe.integrations.hf.HFCausalLM``).

:func:`train_serve_agreement` compares the two modes instead: a training forward against the
served (eval-mode) forward of the same tokens, where a router that routes differently in
training (token rounding, ``ec_predictor``) parts from what it serves.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from moe.record import RoutingRecord
from moe.replay import model_routers, record_routing

PATHS = ("decode", "batch", "chunked_prefill", "bf16_router", "bf16_model", "bf16_model_fp32_router")
"""The figures :func:`agreement_figures` measures by default (see the module docstring)."""

Forward = Callable[[nn.Module, Tensor], object]


@dataclass
class Agreement:
    """How often two paths routed the same tokens to the same experts."""

    reference: str
    """The first path, in words."""
    compared: str
    """The second path, in words."""
    share: float
    """(token, layer) pairs with the same expert set in both paths / all pairs compared."""
    pairs: int
    """(token, layer) pairs compared."""
    per_layer: list[float] = field(default_factory=list)
    """``share`` of each MoE layer."""
    tokens_all_layers: float = 1.0
    """Tokens whose expert sets agree in every layer / tokens."""
    margin: dict | None = None
    """The margin view (:func:`margin_view`): per layer and gap bin, the (token, layer) pairs and
    the share of them whose expert set differs; None where not measured."""
    same_NL: Tensor | None = field(default=None, repr=False)
    """bool [N, L]: which (token, layer) pairs agree (N = B*S in the records' order)."""

    def to_dict(self) -> dict:
        out = {
            "reference": self.reference,
            "compared": self.compared,
            "share": self.share,
            "pairs": self.pairs,
            "per_layer": self.per_layer,
            "tokens_all_layers": self.tokens_all_layers,
        }
        return out if self.margin is None else {**out, "margin": self.margin}

    def line(self) -> str:
        """``reference vs compared: 99.2% of 512 (token, layer) pairs (97.0% of tokens in every layer)``."""
        return (
            f"{self.reference} vs {self.compared}: {100 * self.share:.1f}% of {self.pairs} (token, layer) pairs "
            f"({100 * self.tokens_all_layers:.1f}% of tokens in every layer)"
        )


def routing_agreement(
    a: RoutingRecord, b: RoutingRecord, reference: str = "record a", compared: str = "record b"
) -> Agreement:
    """Compare two records of the same tokens (equal B, S and L; K may differ)."""
    if a.experts.shape[:3] != b.experts.shape[:3]:
        raise ValueError(
            f"records of different tokens or layers: [B, S, L] {list(a.experts.shape[:3])} vs {list(b.experts.shape[:3])}"
        )
    num_ids = int(max(a.experts.max(), b.experts.max(), 0)) + 1
    same_BSL = (_sets(a.experts.cpu(), num_ids) == _sets(b.experts.cpu(), num_ids)).all(-1)
    same_NL = same_BSL.reshape(-1, same_BSL.shape[-1])
    return Agreement(
        reference=reference,
        compared=compared,
        share=same_NL.double().mean().item(),
        pairs=same_NL.numel(),
        per_layer=same_NL.double().mean(0).tolist(),
        tokens_all_layers=same_NL.all(-1).double().mean().item(),
        same_NL=same_NL,
    )


def _sets(experts_BSLK: Tensor, num_ids: int) -> Tensor:
    """bool [B, S, L, num_ids]: the set of experts in each (token, layer)'s slots."""
    mask = torch.zeros(*experts_BSLK.shape[:3], num_ids + 1, dtype=torch.bool)
    index = torch.where(experts_BSLK >= 0, experts_BSLK.long(), num_ids)  # empty slots into a spare column
    return mask.scatter_(-1, index, True)[..., :num_ids]


# -- running one path -------------------------------------------------------------------------
@dataclass
class PathRun:
    """What one path gave the tokens: their routing, and the logits predicted from it."""

    record: RoutingRecord
    logits: Tensor | None
    """float32 [B, T, V] on the CPU (None where the forward returns no ``logits``)."""
    how: str
    """The path in words."""


def call_model(model: nn.Module, idx_BT: Tensor) -> object:
    """The default ``forward``: ``model(idx_BT)``."""
    return model(idx_BT)


def _logits(out: object) -> Tensor | None:
    logits = out if isinstance(out, Tensor) else getattr(out, "logits", None)
    return None if logits is None else logits.detach().float().cpu()


def _cat(parts: list[Tensor | None]) -> Tensor | None:
    return None if any(p is None for p in parts) else torch.cat(parts, 1)


@torch.no_grad()
def run_forward(model: nn.Module, idx_BT: Tensor, forward: Forward = call_model) -> PathRun:
    """One full forward of ``idx_BT``."""
    with record_routing(model) as record:
        out = forward(model, idx_BT)
    return PathRun(record, _logits(out), "full forward")


def record_forward(model: nn.Module, idx_BT: Tensor, forward: Forward = call_model) -> RoutingRecord:
    """The routing of one full forward of ``idx_BT``."""
    return run_forward(model, idx_BT, forward).record


def decode_reason(model: nn.Module) -> str | None:
    """None if ``model`` decodes through a KV cache in its current mode, else why not."""
    support = getattr(model, "decode_support", None)
    if support is None or not hasattr(model, "init_cache"):
        return f"{type(model).__name__} has no KV cache (init_cache / decode_support)"
    return support()


@torch.no_grad()
def run_cached(model: nn.Module, idx_BT: Tensor, chunk: int) -> PathRun:
    """``idx_BT`` fed through the KV cache ``chunk`` tokens at a time."""
    b, t = idx_BT.shape
    cache = model.init_cache(b, t)
    with record_routing(model) as record:
        logits = [_logits(model(idx_BT[:, s : s + chunk], cache=cache)) for s in range(0, t, chunk)]
    how = "KV-cache decoding, one token at a time" if chunk == 1 else f"prefill in chunks of {chunk}"
    return PathRun(record, _cat(logits), how)


@torch.no_grad()
def run_prefixes(model: nn.Module, idx_BT: Tensor, forward: Forward = call_model) -> PathRun:
    """Each position routed, and predicted from, in the forward of its own prefix (decoding
    without a cache)."""
    runs = [run_forward(model, idx_BT[:, : t + 1], forward) for t in range(idx_BT.shape[1])]
    rows = [r.record.experts[:, -1] for r in runs]
    k = max(r.shape[-1] for r in rows)
    padded = [torch.nn.functional.pad(r, (0, k - r.shape[-1]), value=-1) for r in rows]
    logits = _cat([None if r.logits is None else r.logits[:, -1:] for r in runs])
    record = RoutingRecord(rows[0].shape[1], torch.stack(padded, 1))
    return PathRun(record, logits, "each token in the forward of its prefix (no KV cache)")


def run_decoding(model: nn.Module, idx_BT: Tensor, forward: Forward = call_model) -> PathRun:
    """What decoding gives each token: one token at a time through the KV cache where the model
    can, else each token in the forward of its prefix."""
    if decode_reason(model) is None:
        return run_cached(model, idx_BT, 1)
    return run_prefixes(model, idx_BT, forward)


@contextmanager
def router_dtype(model: nn.Module, dtype: str) -> Iterator[None]:
    """Every router of ``model`` computes its scores in ``dtype`` (``moe.routing.ROUTER_DTYPES``) inside."""
    routers = model_routers(model)
    before = [r.router_dtype for r in routers]
    try:
        for r in routers:
            r.router_dtype = dtype
        yield
    finally:
        for r, d in zip(routers, before):
            r.router_dtype = d


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` with its floating-point parameters in ``dtype`` (buffers as they were:
    thresholds and other router state are not weights), in the same mode."""
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for p in copied.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)
    return copied


MARGIN_EDGES = (0.0, 1e-4, 1e-3, 1e-2, 1e-1, math.inf)
"""Bins of the gap between a token's k-th and (k+1)-th gate logit in the margin view."""


def score_gaps(model: nn.Module, idx_BT: Tensor, forward: Forward = call_model) -> Tensor | None:
    """float64 [N, L]: per token and MoE layer, the gap between the k-th and (k+1)-th largest gate
    logit of the full forward (k = the router's ``top_k``), the margin a flip has to cross; None
    where a router sets no integer ``top_k`` below its number of experts (thresholds, top-p, ReLU)."""
    routers = model_routers(model)
    ks = [getattr(r, "top_k", None) for r in routers]
    if any(not isinstance(k, int) or k >= r.num_experts for k, r in zip(ks, routers)):
        return None
    logits: list[Tensor] = [None] * len(routers)

    def keep(i):
        return lambda module, args, out: logits.__setitem__(i, out.detach().double().cpu())

    hooks = [r.gate.register_forward_hook(keep(i)) for i, r in enumerate(routers)]
    try:
        with torch.no_grad():
            forward(model, idx_BT)
    finally:
        for h in hooks:
            h.remove()
    top = [torch.topk(lg, k + 1, dim=-1).values for lg, k in zip(logits, ks)]
    return torch.stack([t[:, -2] - t[:, -1] for t in top], 1)


def margin_view(agreement: Agreement, gaps_NL: Tensor) -> dict:
    """Per layer and :data:`MARGIN_EDGES` bin of the reference's gap: the pairs, and the share of
    them that flipped (expert sets that differ): where the flips sit."""
    edges = torch.tensor(MARGIN_EDGES, dtype=torch.float64)
    bin_NL = (torch.bucketize(gaps_NL, edges, right=True) - 1).clamp(0, len(MARGIN_EDGES) - 2)
    pairs, flipped = [], []
    for layer in range(gaps_NL.shape[1]):
        count = torch.bincount(bin_NL[:, layer], minlength=len(MARGIN_EDGES) - 1)
        flips = torch.bincount(
            bin_NL[:, layer], weights=(~agreement.same_NL[:, layer]).double(), minlength=count.numel()
        )
        pairs.append(count.tolist())
        flipped.append((flips / count.clamp_min(1)).tolist())
    return {"edges": list(MARGIN_EDGES), "pairs": pairs, "flip_share": flipped}


# -- the figures ------------------------------------------------------------------------------
def agreement_figures(
    model: nn.Module,
    idx_BT: Tensor,
    *,
    paths: tuple[str, ...] | list[str] = PATHS,
    chunk: int | None = None,
    forward: Forward = call_model,
) -> dict[str, Agreement | str]:
    """Each figure of ``paths`` (see the module docstring) on the token ids ``idx_BT`` [B, T],
    in eval mode: an :class:`Agreement`, or the reason it was not measured (one sequence has
    no batch to compare; a model without a KV cache has no chunked prefill). ``chunk``: prefill
    chunk length (default ceil(T / 4)). Each figure carries its margin view (:func:`margin_view`
    on the full forward's gate logits) where every router has a ``top_k``. The model's mode and
    state are as before afterwards."""
    bad = [p for p in paths if p not in PATHS]
    if bad:
        raise ValueError(f"unknown agreement paths {bad}; known: {', '.join(PATHS)}")
    if not isinstance(idx_BT, Tensor) or idx_BT.dim() != 2 or idx_BT.is_floating_point():
        raise ValueError(f"agreement figures need token ids [B, T], got {getattr(idx_BT, 'shape', idx_BT)}")
    was_training = model.training
    model.eval()
    try:
        full = record_forward(model, idx_BT, forward)
        figures = {p: _FIGURES[p](model, idx_BT, full, forward, chunk) for p in paths}
        gaps_NL = score_gaps(model, idx_BT, forward)
        for figure in figures.values():
            if gaps_NL is not None and isinstance(figure, Agreement):
                figure.margin = margin_view(figure, gaps_NL)
        return figures
    finally:
        model.train(was_training)


def _decode(model, idx_BT, full, forward, chunk) -> Agreement:
    decoded = run_decoding(model, idx_BT, forward)
    return routing_agreement(full, decoded.record, "full forward", decoded.how)


def _batch(model, idx_BT, full, forward, chunk) -> Agreement | str:
    b = idx_BT.shape[0]
    if b < 2:
        return "one sequence: no batch to compare it with"
    alone = [record_forward(model, idx_BT[i : i + 1], forward).experts for i in range(b)]
    k = max(a.shape[-1] for a in alone)
    rows = torch.cat([torch.nn.functional.pad(a, (0, k - a.shape[-1]), value=-1) for a in alone])
    return routing_agreement(full, RoutingRecord(full.num_layers, rows), f"{b} sequences in one batch", "each alone")


def _chunked(model, idx_BT, full, forward, chunk) -> Agreement | str:
    reason = decode_reason(model)
    if reason is not None:
        return f"no chunked prefill: {reason}"
    c = chunk or math.ceil(idx_BT.shape[1] / 4)
    whole = run_cached(model, idx_BT, idx_BT.shape[1]).record
    chunked = run_cached(model, idx_BT, c)
    return routing_agreement(whole, chunked.record, "prefill in one cached forward", chunked.how)


def _precision(weights: torch.dtype | None, scores: str | None, label: str):
    def figure(model, idx_BT, full, forward, chunk) -> Agreement:
        ref_model = model if _dtype(model) == torch.float32 else cast_parameters(model, torch.float32)
        reference = full if ref_model is model else record_forward(ref_model, idx_BT, forward)
        other = ref_model if weights is None else cast_parameters(ref_model, weights)
        with router_dtype(other, scores):
            compared = record_forward(other, idx_BT, forward)
        return routing_agreement(reference, compared, "fp32 weights, router as configured", label)

    return figure


def _dtype(model: nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


_FIGURES = {
    "decode": _decode,
    "batch": _batch,
    "chunked_prefill": _chunked,
    "bf16_router": _precision(None, "bf16", "fp32 weights, router in bf16"),
    "bf16_model": _precision(torch.bfloat16, "input", "bf16 weights, router in bf16"),
    "bf16_model_fp32_router": _precision(torch.bfloat16, "fp32", "bf16 weights, router in fp32"),
}


def train_serve_agreement(model: nn.Module, idx_BT: Tensor, forward: Forward = call_model) -> Agreement:
    """How often a training forward (train mode, no gradient) routes the tokens of ``idx_BT``
    [B, T] as the served full forward (eval mode) does: 1 where a router routes alike in both
    modes, less for one that trains on another routing than it serves (token rounding's rounded
    counts, ``ec_predictor``'s expert choice against its predictor). The training forward runs
    on a copy, so no statistic a router keeps moves; the model's mode is as before afterwards."""
    was_training = model.training
    trained = copy.deepcopy(model).train()
    try:
        train = record_forward(trained, idx_BT, forward)
        served = record_forward(model.eval(), idx_BT, forward)
    finally:
        model.train(was_training)
    return routing_agreement(train, served, "training forward (train mode)", "served forward (eval mode)")
