"""The routing contract shared by every router, the MoE layer, the kernels and the audit.

Shape legend (used in names as suffixes, e.g. ``logits_NE``):
    B batch, T sequence length, N = B*T flattened tokens (row-major: n = b*T + t),
    D model width, E experts, K top-k, C capacity per expert and group,
    G number of routing groups, A kept (token, expert) assignments.

Decoding: a router routes a chunk of new tokens given what it routed before through an
explicit :class:`DecodeState` (``state = router.init_decode_state(B)``, then
``router(x_BTD, decode_state=state)`` for each chunk). Routers whose claims say they are not
decode-consistent refuse with a ValueError.

Host synchronisation: the default forward, backward and ``update_after_step`` read no tensor
value on the host (no ``.item()``, ``bool(tensor)``, ``.tolist()``, ``int()``/``float()``
of a tensor, ``torch.bincount``). What remains is inherent to the compact Routing: a router
whose number of kept assignments A depends on the data (capacity drops, thresholds, the
predictor) learns A on the host when it selects the kept rows. The fixed-size form avoids
it: every candidate assignment is listed, ``valid`` marks the kept ones and the others carry
weight exactly 0 (the capacity router returns it while traced by ``torch.compile``, where a
data-dependent A would break the graph). Checking the logits for NaN/inf needs a read too;
it runs only with ``check_finite=True`` or ``MOE_DEBUG=1``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.checks import positive_int
from moe.exact import exact_active, warn_inexact

ROUTER_DTYPES: dict[str, torch.dtype | None] = {
    "fp32": torch.float32,
    "fp64": torch.float64,
    "bf16": torch.bfloat16,
    "input": None,
    "bf16_fp32": torch.float32,
}
"""``Router(router_dtype=...)`` -> the dtype router logits are computed in (None: the input's);
Megatron-Core's ``moe_router_dtype`` offers fp32 and fp64. ``"bf16_fp32"``: bf16 inputs and gate
weight, fp32 accumulation and fp32 logits, without casting the activations to fp32 first
(:class:`GateLinear`)."""


@dataclass
class Routing:
    """The kept (token, expert, weight) assignments of one forward pass.

    ``token``, ``expert`` and ``weight`` are parallel 1-D tensors of length A. A token may
    appear zero times (dropped) or several times; an expert may receive no token.

    Fixed-size form (``valid`` given): the A rows are candidates, ``valid`` says which were
    kept, and a row that was not kept has weight exactly 0 with no gradient path. Every data
    path (dispatch -> experts -> combine) gives the same result for either form, since a
    zero-weight row adds nothing; :meth:`compact` returns the kept rows only.
    """

    token: Tensor
    """int64 [A]: flat token index n = b*T + t of each kept assignment."""
    expert: Tensor
    """int64 [A]: expert index in [0, E)."""
    weight: Tensor
    """float [A]: combine weight, differentiable w.r.t. the router parameters."""
    num_tokens: int
    """N = B*T."""
    num_experts: int
    """E."""
    aux_loss: Tensor
    """Scalar: the router's training losses, already weighted by their coefficients."""
    stats: dict[str, Tensor] = field(default_factory=dict)
    """At least ``tokens_per_expert`` (int64 [E]) and ``dropped_fraction`` (scalar)."""
    batch_shape: tuple[int, int] | None = None
    """(B, T) of the routed input, so that :meth:`dense` can restore it."""
    valid: Tensor | None = None
    """bool [A] or None: which rows were kept (fixed-size form, see the class docstring);
    None: every row was kept."""

    def __post_init__(self) -> None:
        a = self.token.shape
        if self.token.dim() != 1 or self.expert.shape != a or self.weight.shape != a:
            raise ValueError(
                f"Routing fields must be 1-D of equal length, got token {tuple(self.token.shape)}, "
                f"expert {tuple(self.expert.shape)}, weight {tuple(self.weight.shape)}"
            )
        if self.valid is not None and (self.valid.shape != a or self.valid.dtype != torch.bool):
            raise ValueError(
                f"valid must be a bool tensor of shape {tuple(a)}, got {self.valid.dtype} {tuple(self.valid.shape)}"
            )
        if self.batch_shape is None:
            self.batch_shape = (1, self.num_tokens)
        elif self.batch_shape[0] * self.batch_shape[1] != self.num_tokens:
            raise ValueError(f"batch_shape {self.batch_shape} does not multiply to num_tokens {self.num_tokens}")

    @property
    def num_assignments(self) -> int:
        """Kept assignments (reads ``valid`` on the host in the fixed-size form)."""
        return self.token.numel() if self.valid is None else int(self.valid.sum())

    def compact(self) -> Routing:
        """The kept rows only (``valid=None``); the fixed-size form's A is read on the host."""
        if self.valid is None:
            return self
        keep = self.valid
        return replace(self, token=self.token[keep], expert=self.expert[keep], weight=self.weight[keep], valid=None)

    def dense(self) -> Tensor:
        """The [B, T, E] combine-weight matrix, zero where a token was not routed to an expert."""
        w_NE = self.weight.new_zeros(self.num_tokens, self.num_experts)
        w_NE = w_NE.index_put((self.token, self.expert), self.weight, accumulate=True)
        b, t = self.batch_shape
        return w_NE.view(b, t, self.num_experts)

    def mask(self) -> Tensor:
        """Boolean [B, T, E]: which (token, expert) pairs were kept. Exact, unlike thresholds on dense()."""
        m_NE = torch.zeros(self.num_tokens, self.num_experts, dtype=torch.bool, device=self.token.device)
        m_NE[self.token, self.expert] = True if self.valid is None else self.valid
        b, t = self.batch_shape
        return m_NE.view(b, t, self.num_experts)

    def experts_per_token(self) -> Tensor:
        """int64 [N]: how many experts each token was routed to (0 = dropped)."""
        return count_indices(self.token, self.num_tokens, self.valid)

    def experts_per_token_histogram(self) -> Tensor:
        """int64 [E + 1]: how many tokens were routed to 0, 1, ..., E experts (no host read)."""
        return count_indices(self.experts_per_token(), self.num_experts + 1)


@dataclass(frozen=True)
class Claims:
    """What a router promises; the audit verifies every claim."""

    causal_train: bool
    """In training mode, the routing of position t depends only on positions <= t."""
    causal_eval: bool
    """The same in eval mode."""
    batch_invariant: bool
    """A sample's routing does not depend on the other samples of the batch (in both modes)."""
    decode_consistent: bool = False
    """In every mode where it is causal, routing the prefix 0..t alone gives position t the
    same experts and weights as routing the whole sequence (what decoding sees). Causal is not
    enough: a capacity sized from the sequence length T changes with the prefix length.
    A decode-consistent router routes new tokens from a :class:`DecodeState`
    (:meth:`Router.init_decode_state`)."""


@dataclass
class DecodeState:
    """What a router keeps between the chunks of B sequences decoded together: every sequence
    of the batch is at the same absolute position. Created by :meth:`Router.init_decode_state`
    and updated in place by each ``router(x_BTD, decode_state=state)``. Routers whose routing
    of a token depends on that token alone (``topk``, ``ec_threshold``, ``ec_predictor`` in eval
    mode) need nothing more; others subclass it (``capacity`` keeps per-expert kept counts)."""

    batch_size: int
    """B: sequences decoded together."""
    position: int = 0
    """Tokens of each sequence routed so far: the next chunk starts at this absolute position."""


@dataclass
class RouterContext:
    """What the code around a router hands it while it runs (``router.context``): the one object
    through which replay, data- or expert-parallel statistics and the global balance loss reach a
    router, which reads it. Each field's default is the router alone (its own choices, its own
    batch's counts); the functions named below set a field and put it back."""

    routing_hook: Callable | None = None
    """None (route as usual), or a callable with :meth:`Router.route_tokens`' signature that routes
    in its place: ``moe.record_routing`` and ``moe.replay_routing`` set one per router while they run."""
    stats_group: object | None = None
    """Process group over which the load-balancing loss counts assignments (set by data- or
    expert-parallel training, see ``moe.parallel.share_router_statistics``): with equal
    shards the mean of the ranks' aux losses then equals the single-process one, in value and
    gradient. None: the local batch only."""
    global_load: Tensor | None = None
    """float64 [X]: the assignment counts of the step's whole global batch, which the global
    balance loss reads while set (by :func:`moe.global_balance.global_batch_loads`, for one
    step of several microbatches); None: the forward's own counts over ``stats_group``."""
    load_counter: Tensor | None = None
    """float64 [X] while :func:`moe.global_balance.global_batch_loads` counts the step's
    assignments: every forward adds its counts here."""


class Router(nn.Module):
    """The base of every router: a bias-free linear gate, input checks, aux losses and stats.

    A new router is one file in ``moe/routers/``: a subclass registered by name
    (``@register_router("name")``, imported and given a row of ``moe.routers.ROUTER_TABLE``).
    It subclasses ``Router`` itself, or a family's base when it extends that family's rule:
    ``TokenChoiceBase`` (``moe/routers/token_choice.py``: score functions, top-k selection,
    expert groups, balance bias, their replay weights) or ``ExpertChoiceBase``
    (``moe/routers/expert_choice.py``: capacity factor and groups). Either way these are the
    only hooks a router has:

    ==================================================================  ======================================
    hook                                                                implement
    ==================================================================  ======================================
    ``route_local(logits_NE, batch_shape, record, expert_NK)``          if ``token_local``
    ``claims`` (property): its :class:`Claims`                          always, unless ``token_local``
    ``route(logits_NE, x_BTD, batch_shape)``: a full forward            always, unless ``token_local``
    ``route_decode(logits_NE, x_BTD, batch_shape, state)``              if decoding reads the past
    ``init_decode_state(batch_size)``: a :class:`DecodeState`           if it keeps decode state
    ``decode_support()``: why it cannot decode here, or None            to override the claims
    ``replay(logits_NE, x_BTD, batch_shape, expert_NK, decoding)``      to be replayed, unless ``token_local``
    ``update_after_step()``: state learned from past steps              if it learns such state
    ``nominal_experts_per_token()``: experts per token it sets          if its options set one
    ==================================================================  ======================================

    A router whose routing of token n reads token n alone (and state learned from past training
    forwards: a bias, thresholds, a coefficient) says so with ``token_local = True`` and
    implements :meth:`route_local` only: ``Router`` then gives it its claims (causal,
    batch-invariant and decode-consistent in both modes) and ``route``, ``route_decode`` and
    ``replay``, each a call of ``route_local``, which knows from ``record`` whether the forward
    is one whose statistics it may keep. Otherwise ``route_decode`` defaults to ``route`` (a
    token routed from itself alone). ``logits_NE`` are the gate's logits in ``router_dtype``
    (:meth:`score_logits`). What the code around a router hands it (replay's hook, the
    statistics group, the global batch's loads) is in :attr:`context` (:class:`RouterContext`),
    which the router reads and nobody sets on it otherwise.

    Aux losses (:meth:`_aux_loss`): the Switch load-balancing loss ``E * sum_e f_e * P_e``
    (f_e: fraction of the assignments counted to e, P_e: mean router probability) at three
    granularities, each with its coefficient, as Megatron-Core's ``TopKRouter`` offers them
    (megatron/core/transformer/moe/router.py: ``aux_loss``, ``seq_aux_loss``,
    ``global_aux_loss``; arXiv 2501.11873): ``aux_loss_coef`` counts f over the forward's
    micro-batch (over the context's ``stats_group`` too), ``seq_aux_loss_coef`` per sequence (the mean of the
    B sequences' losses), ``global_aux_loss_coef`` over the step's global batch (every
    microbatch and data-parallel rank, see :mod:`moe.global_balance`); ``z_loss_coef`` weights
    the router z-loss ``mean(logsumexp(logits)^2)``.

    ``router_dtype`` says in which dtype the gate's logits (and so the scores, the choices and
    the combine weights) are computed, whatever the model's dtype (:data:`ROUTER_DTYPES`):
    "fp32" (default; fp64 for an fp64 input), "fp64", "bf16", "input" (the model's own,
    which reproduces a low-precision router's flipped near-ties), or "bf16_fp32" (bf16 inputs,
    fp32 accumulation and logits: the GEMM form without casting the activations).

    ``check_finite`` raises a ValueError on NaN/inf router logits. It reads a tensor value on
    the host (a GPU->CPU synchronisation on every call), so it is off by default; None (the
    default) turns it on iff the environment variable ``MOE_DEBUG`` is ``1`` when the router is
    built.

    Decoding (see :class:`DecodeState`): ``state = router.init_decode_state(B)``, then
    ``router(x_BTD, decode_state=state)`` routes the next T tokens of each sequence exactly as
    the full-sequence forward routes them. Decode-consistent subclasses implement
    :meth:`route_decode`, and override :meth:`init_decode_state` if they need state beyond the
    position.
    """

    name: str = ""
    context: RouterContext
    """What the code around the router hands it (set in ``__init__``; see :class:`RouterContext`)."""
    token_local: bool = False
    """True for a router whose routing of token n reads token n alone and state learned from past
    training forwards: it implements :meth:`route_local`, from which ``Router`` gives it its
    claims, :meth:`route`, :meth:`route_decode` and :meth:`replay` (see the hook table)."""
    reads_token_ids: bool = False
    """True for a router that routes by token id (``hash``): it is called as
    ``router(x_BTD, token_ids_BT=ids)``, and ``MoELayer`` passes it the ids it is given."""

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        *,
        aux_loss_coef: float = 0.01,
        seq_aux_loss_coef: float = 0.0,
        global_aux_loss_coef: float = 0.0,
        z_loss_coef: float = 1e-3,
        check_finite: bool | None = None,
        router_dtype: str = "fp32",
    ) -> None:
        super().__init__()
        positive_int("d_model", d_model)
        positive_int("num_experts", num_experts)
        coefs = {
            "aux_loss_coef": aux_loss_coef,
            "seq_aux_loss_coef": seq_aux_loss_coef,
            "global_aux_loss_coef": global_aux_loss_coef,
            "z_loss_coef": z_loss_coef,
        }
        bad = {k: v for k, v in coefs.items() if not v >= 0}
        if bad:
            raise ValueError(f"loss coefficients must be >= 0, got {bad}")
        if router_dtype not in ROUTER_DTYPES:
            raise ValueError(f"router_dtype must be one of {', '.join(ROUTER_DTYPES)}, got {router_dtype!r}")
        self.router_dtype = router_dtype
        self.d_model = d_model
        self.num_experts = num_experts
        self.aux_loss_coef = aux_loss_coef
        self.seq_aux_loss_coef = seq_aux_loss_coef
        self.global_aux_loss_coef = global_aux_loss_coef
        self.z_loss_coef = z_loss_coef
        self.check_finite = os.environ.get("MOE_DEBUG") == "1" if check_finite is None else bool(check_finite)
        self.gate = GateLinear(d_model, num_experts)
        nn.init.normal_(self.gate.weight, std=d_model**-0.5)
        self.context = RouterContext()

    # -- claims -------------------------------------------------------------------------
    @property
    def claims(self) -> Claims:
        if self.token_local:
            return Claims(causal_train=True, causal_eval=True, batch_invariant=True, decode_consistent=True)
        raise NotImplementedError

    @property
    def causal(self) -> bool:
        """The causality claim for the current mode (``self.training``)."""
        c = self.claims
        return c.causal_train if self.training else c.causal_eval

    def decode_support(self) -> str | None:
        """None if this router can route new tokens from a :class:`DecodeState` in the current
        mode, else why not (the claims say it is not decode-consistent, or not causal here)."""
        c = self.claims
        mode = "training" if self.training else "eval"
        if not c.decode_consistent:
            return (
                f"router {self.name!r} ({type(self).__name__}) is not decode-consistent: routing a prefix alone "
                "does not reproduce the full-sequence routing, so it cannot route new tokens from a decode state"
            )
        if not self.causal:
            return (
                f"router {self.name!r} ({type(self).__name__}) is not causal in {mode} mode, so it cannot decode there"
            )
        return None

    def init_decode_state(self, batch_size: int) -> DecodeState:
        """A fresh decode state for ``batch_size`` sequences at position 0; ValueError if this
        router cannot decode in the current mode (see :meth:`decode_support`)."""
        reason = self.decode_support()
        if reason is not None:
            raise ValueError(reason)
        positive_int("batch_size", batch_size)
        return DecodeState(batch_size)

    # -- forward ------------------------------------------------------------------------
    def forward(self, x_BTD: Tensor, decode_state: DecodeState | None = None) -> Routing:
        """Route x [B, T, D]. With ``decode_state``, x holds the next T tokens of each of the
        state's B sequences (absolute positions ``state.position ...``): the routing is that of
        those rows in a full-sequence forward, and the state advances by T."""
        check_input(x_BTD, self.d_model)
        b, t, _ = x_BTD.shape
        logits_NE = self.score_logits(x_BTD.reshape(b * t, -1))
        if self.check_finite and not torch.isfinite(logits_NE).all():
            raise ValueError(
                f"{type(self).__name__}: router logits contain NaN or inf "
                f"(input has {int((~torch.isfinite(x_BTD)).sum())} non-finite values)"
            )
        if decode_state is not None:
            reason = self.decode_support()
            if reason is not None:
                raise ValueError(reason)
            if decode_state.batch_size != b:
                raise ValueError(
                    f"decode state is for batch size {decode_state.batch_size}, got input of shape {tuple(x_BTD.shape)}"
                )
        if exact_active() and not (self.causal and self.claims.batch_invariant):
            warn_inexact(f"router {self.name!r}", "its choice of a token reads other tokens (see its claims)")
        hook = self.context.routing_hook
        route = self.route_tokens if hook is None else hook
        routing = route(logits_NE, x_BTD, (b, t), decode_state)
        if decode_state is not None:
            decode_state.position += t
        return routing

    def score_logits(self, x_ND: Tensor) -> Tensor:
        """The gate's logits [N, E] in the dtype ``router_dtype`` names (:class:`GateLinear`): a
        low-precision model then ranks its experts on fp32 (or fp64) scores, not on logits
        already rounded to bf16."""
        dtype = ROUTER_DTYPES[self.router_dtype]
        if self.router_dtype == "bf16_fp32":
            return self.gate(x_ND, dtype=dtype, inputs=torch.bfloat16)
        if dtype is not None and self.router_dtype == "fp32":
            dtype = torch.promote_types(dtype, x_ND.dtype)
        return self.gate(x_ND, dtype=dtype)

    def route_tokens(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], decode_state: DecodeState | None
    ) -> Routing:
        """The router's own choice: :meth:`route`, or :meth:`route_decode` with a decode state."""
        if decode_state is None:
            return self.route(logits_NE, x_BTD, batch_shape)
        return self.route_decode(logits_NE, x_BTD, batch_shape, decode_state)

    def route(self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int]) -> Routing:
        if self.token_local:
            return self.route_local(logits_NE, batch_shape, record=self.training)
        raise NotImplementedError

    def replay(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], expert_NK: Tensor, decoding: bool
    ) -> Routing:
        """Route with given choices (``moe.replay_routing``): token n goes to the experts
        ``expert_NK[n]`` (int64 [N, K], -1 = an empty slot), whatever the scores say, with the
        combine weights this router's formula gives them from the current ``logits_NE`` (so the
        gate still gets a gradient), and the aux loss and statistics a forward that chose them
        would have. ``decoding``: the tokens are a decoded chunk (no statistics are kept). Every
        built-in router implements it; with the weights unchanged since the choices were recorded
        it returns the recorded forward's routing bit for bit. A ``token_local`` router replays
        through :meth:`route_local` (its own weight formula and aux loss at the given choices;
        a training forward's statistics as a forward that made them would keep)."""
        if self.token_local:
            return self.route_local(logits_NE, batch_shape, record=self.training and not decoding, expert_NK=expert_NK)
        raise NotImplementedError(f"{type(self).__name__} cannot replay recorded routing")

    def route_decode(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], state: DecodeState
    ) -> Routing:
        """Route the next T tokens of each sequence (positions ``state.position ...``); called
        only when :meth:`decode_support` allows it; ``forward`` advances the state. Default:
        :meth:`route_local` recording nothing for a ``token_local`` router, else :meth:`route`,
        right for a router whose routing of a token reads that token alone in the modes where it
        decodes (``topk``, ``hash``, eval-mode ``ec_predictor``); a router whose routing reads
        earlier positions overrides it with its :class:`DecodeState`."""
        if self.token_local:
            return self.route_local(logits_NE, batch_shape, record=False)
        return self.route(logits_NE, x_BTD, batch_shape)

    def route_local(
        self, logits_NE: Tensor, batch_shape: tuple[int, int], record: bool, expert_NK: Tensor | None = None
    ) -> Routing:
        """The one hook of a ``token_local`` router: route every token from itself alone.
        ``record`` is True exactly in a training forward that is not decoding, the only forwards
        whose statistics the router may keep (an evaluation or a decoded chunk changes nothing);
        ``expert_NK`` (int64 [N, K], -1 = an empty slot; ``replay``): route token n to those
        experts instead of choosing, with the router's own weights and aux loss at them."""
        raise NotImplementedError

    def update_after_step(self) -> None:
        """Apply state learned from past batches (balancing bias, thresholds). Call after each
        optimiser step; see :func:`moe.layer.update_routers`. Default: nothing to do."""

    def nominal_experts_per_token(self) -> float | None:
        """The mean number of experts per token that this router's options set (top-k: k;
        expert choice and thresholds: the capacity factor; routers that hold a target: the
        target), by which a study equates active compute; None where the options set no such
        number (a fixed top-p threshold). The measured number is in the training metrics."""
        return None

    # -- shared pieces ------------------------------------------------------------------
    def has_balance_loss(self) -> bool:
        """Whether any of the three load-balancing losses has a coefficient > 0."""
        return self.aux_loss_coef > 0 or self.seq_aux_loss_coef > 0 or self.global_aux_loss_coef > 0

    def _aux_loss(
        self,
        logits_NE: Tensor,
        probs_NX: Tensor,
        expert_A: Tensor,
        token_A: Tensor | None = None,
        batch_shape: tuple[int, int] | None = None,
    ) -> Tensor:
        """The load-balancing losses over the X columns of ``probs_NX`` (the E experts, or E
        plus null experts), counting the assignments (``token_A``, ``expert_A``), plus the
        z-loss of ``logits_NE``. Each is ``coef * X * sum_x f_x * P_x`` with f the fraction of
        the counted assignments and P the mean probability, the form of Megatron-Core's
        ``switch_load_balancing_loss_func`` (moe_utils.py; for top-k, f_x = count_x / (k T)):

        * micro-batch (``aux_loss_coef``): f and P over this forward's N tokens, f counted over
          ``stats_group`` too. Megatron's ``_apply_aux_loss`` counts over the tensor- and
          context-parallel ranks of one micro-batch only; counting over the data-parallel
          ranks as well makes the loss that of one process given the same microbatches of the
          whole batch, whatever the data-parallel degree.
        * sequence (``seq_aux_loss_coef``): f and P of each of the B sequences, the mean of the
          B losses (Megatron's ``_apply_seq_aux_loss``; DeepSeek-V3's sequence-wise balance
          loss, arXiv 2412.19437 eq. 17-20). A sequence is never split, so no layout changes it.
          It needs the assignments' tokens and the (B, T) shape: a router that does not pass
          ``token_A`` and ``batch_shape`` refuses the option when it routes.
        * global batch (``global_aux_loss_coef``): f over the step's whole batch, P over this
          forward (Megatron's ``_apply_global_aux_loss``; arXiv 2501.11873). f is
          ``context.global_load`` when set (the counts of every microbatch and data-parallel rank,
          gathered before the step's first loss by :mod:`moe.global_balance`), else this
          forward's counts over ``stats_group`` (the global batch when a step is one forward).
          Megatron instead lets microbatch i read the running mean of the counts of
          microbatches 1..i, so its loss depends on how the batch is cut; this one does not.
        """
        if not self.has_balance_loss():
            return self._z_loss(logits_NE)
        loss = logits_NE.new_zeros(())
        x = probs_NX.shape[1]
        count_X = count_indices(expert_A, x).to(probs_NX.dtype)
        ctx = self.context
        if ctx.load_counter is not None:
            ctx.load_counter = ctx.load_counter + count_X.detach().double()
        mean_X = probs_NX.mean(0)
        shared_X = None
        if self.aux_loss_coef > 0 or (self.global_aux_loss_coef > 0 and ctx.global_load is None):
            shared_X = count_X.clone()
            if ctx.stats_group is not None:
                torch.distributed.all_reduce(shared_X, group=ctx.stats_group)
        if self.aux_loss_coef > 0:
            loss = loss + self.aux_loss_coef * x * (fractions(shared_X) * mean_X).sum()
        if self.seq_aux_loss_coef > 0:
            if token_A is None or batch_shape is None:
                raise ValueError(f"router {self.name!r} does not support seq_aux_loss_coef (it passes no token ids)")
            b, t = batch_shape
            count_BX = count_indices((token_A // t) * x + expert_A, b * x).view(b, x).to(probs_NX.dtype)
            mean_BX = probs_NX.view(b, t, x).mean(1)
            loss = loss + self.seq_aux_loss_coef * x * (fractions(count_BX) * mean_BX).sum(-1).mean()
        if self.global_aux_loss_coef > 0:
            global_X = shared_X if ctx.global_load is None else ctx.global_load.to(probs_NX.dtype)
            loss = loss + self.global_aux_loss_coef * x * (fractions(global_X) * mean_X).sum()
        return loss + self._z_loss(logits_NE)

    def _assignment_fractions(self, expert_A: Tensor, size: int, dtype: torch.dtype) -> Tensor:
        """float [size]: the fraction of assignments to each expert, counted over the context's ``stats_group``."""
        count_E = count_indices(expert_A, size).to(dtype)
        if self.context.stats_group is not None:
            torch.distributed.all_reduce(count_E, group=self.context.stats_group)
        return fractions(count_E)

    def _track_active_experts(self) -> None:
        """Keep the mean number of experts per token of a step's recorded forwards
        (:meth:`_record_active`, :meth:`_pop_active_excess`), for a router whose controller holds
        that mean at a target."""
        self.register_buffer("pending_active", torch.zeros((), dtype=torch.float64))
        self.register_buffer("pending_count", torch.zeros((), dtype=torch.float64))

    @torch.no_grad()
    def _record_active(self, active_NE: Tensor) -> None:
        """Count one forward's mean experts per token (``active_NE``: bool [N, E])."""
        self.pending_active += active_NE.double().sum(1).mean()
        self.pending_count += 1

    @torch.no_grad()
    def _pop_active_excess(self, target: float) -> Tensor:
        """sign(mean experts per token of the recorded forwards - ``target``), 0 if none was
        recorded (chosen on the device: no host read); the count starts again."""
        active = self.pending_active / self.pending_count.clamp_min(1.0)
        excess = torch.where(self.pending_count > 0, torch.sign(active - target), torch.zeros_like(active))
        self.pending_active.zero_()
        self.pending_count.zero_()
        return excess

    def _z_loss(self, logits_NE: Tensor) -> Tensor:
        if self.z_loss_coef == 0:
            return logits_NE.new_zeros(())
        return self.z_loss_coef * torch.logsumexp(logits_NE, dim=-1).square().mean()

    def _stats(self, expert_A: Tensor, num_slots: int, valid_A: Tensor | None = None) -> dict[str, Tensor]:
        """``valid_A``: the kept rows of a fixed-size routing (None: all of ``expert_A``)."""
        tokens_per_expert_E = count_indices(expert_A, self.num_experts, valid_A)
        kept = expert_A.numel() if valid_A is None else tokens_per_expert_E.sum()
        return {
            "tokens_per_expert": tokens_per_expert_E,
            "dropped_fraction": dropped_fraction(kept, num_slots, expert_A.device),
        }

    def extra_repr(self) -> str:
        c = self.claims
        return (
            f"d_model={self.d_model}, num_experts={self.num_experts}, causal_train={c.causal_train}, "
            f"causal_eval={c.causal_eval}, batch_invariant={c.batch_invariant}"
        )


def held_claims(module: nn.Module) -> Claims:
    """What a module routing through the routers it holds promises: each claim where every
    :class:`Router` inside it makes it (one holding none, as a dense block, promises them all).
    ``MoELayer`` and ``MoETransformer`` declare their ``claims`` with it; ``moe.audit`` reads a
    module's ``claims``, and this for a module that holds routers but declares nothing."""
    claims = [m.claims for m in module.modules() if isinstance(m, Router)]
    return Claims(
        causal_train=all(c.causal_train for c in claims),
        causal_eval=all(c.causal_eval for c in claims),
        batch_invariant=all(c.batch_invariant for c in claims),
        decode_consistent=all(c.decode_consistent for c in claims),
    )


class GateLinear(nn.Linear):
    """A router's bias-free gate: ``gate(x_ND, dtype=d)`` is ``x W^T`` computed in ``d``, input
    and weight cast to it and autocast off, as Megatron-Core's ``router_gating_linear`` computes
    in its ``moe_router_dtype``; ``dtype=None``: as ``nn.Linear`` computes (autocast included). A
    module call either way, so forward hooks on the gate see the logits."""

    def __init__(self, d_model: int, num_experts: int) -> None:
        super().__init__(d_model, num_experts, bias=False)

    def forward(self, x_ND: Tensor, dtype: torch.dtype | None = None, inputs: torch.dtype | None = None) -> Tensor:
        """``inputs``: the GEMM reads x and the weight in this dtype and accumulates and returns
        ``dtype`` (bf16 in, fp32 out: ``torch.mm(..., out_dtype=)`` on CUDA; on CPU, which has no
        such kernel in torch 2.13, the exact upcast of the bf16 values, the same products and
        fp32 sums)."""
        if dtype is None:
            return super().forward(x_ND)
        with torch.autocast(x_ND.device.type, enabled=False):
            if inputs is None:
                return F.linear(x_ND.to(dtype), self.weight.to(dtype))
            x_ND, weight = x_ND.to(inputs), self.weight.to(inputs)
            if x_ND.is_cuda:
                return torch.mm(x_ND, weight.t(), out_dtype=dtype)
            return F.linear(x_ND.to(dtype), weight.to(dtype))


def check_input(x_BTD: Tensor, d_model: int) -> None:
    """Raise ValueError unless x is a floating [B, T, d_model] tensor with B, T >= 1."""
    if not isinstance(x_BTD, Tensor):
        raise ValueError(f"expected a torch.Tensor of shape [B, T, {d_model}], got {type(x_BTD).__name__}")
    if not x_BTD.is_floating_point():
        raise ValueError(
            f"expected floating-point features of shape [B, T, {d_model}], got dtype {x_BTD.dtype} "
            "(token ids go through an embedding first)"
        )
    if x_BTD.dim() != 3:
        raise ValueError(f"expected input of shape [B, T, D={d_model}], got {tuple(x_BTD.shape)}")
    if x_BTD.shape[-1] != d_model:
        raise ValueError(f"expected last dimension D={d_model}, got input of shape {tuple(x_BTD.shape)}")
    if not x_BTD.shape[0] or not x_BTD.shape[1]:
        raise ValueError(
            f"expected at least one sequence of at least one token, got input of shape {tuple(x_BTD.shape)}"
        )


def fractions(count_X: Tensor) -> Tensor:
    """``count_X`` divided by its sum over the last dimension (rows of zeros stay zero)."""
    return count_X / count_X.sum(-1, keepdim=True).clamp_min(1.0)


def served_stats(token_A: Tensor, expert_A: Tensor, num_tokens: int, num_experts: int) -> dict[str, Tensor]:
    """The stats of a router whose tokens get a varying number of experts: ``tokens_per_expert``
    and, as ``dropped_fraction``, the fraction of the N tokens that got no expert at all."""
    served = count_indices(token_A, num_tokens) > 0
    return {
        "tokens_per_expert": count_indices(expert_A, num_experts),
        "dropped_fraction": dropped_fraction(served.sum(), num_tokens, served.device),
    }


def dropped_fraction(kept: int | Tensor, num_slots: int, device: torch.device) -> Tensor:
    """Scalar tensor 1 - kept / num_slots, at least 0 (0 without slots): the ``dropped_fraction``
    stat of every router (token choice: kept assignments of N*K slots; expert choice: tokens
    served of N). A tensor ``kept`` stays on the device; an int is filled in with torch.full, not
    torch.tensor, whose host-to-device copy would wait for the device."""
    if num_slots <= 0:
        return torch.zeros((), device=device)
    if isinstance(kept, Tensor):
        return (1.0 - kept.float() / num_slots).clamp_min(0.0)
    return torch.full((), max(1.0 - kept / num_slots, 0.0), device=device)


def count_indices(index_A: Tensor, size: int, include_A: Tensor | None = None) -> Tensor:
    """int64 [size]: how often each value in [0, size) occurs in ``index_A`` (only where the
    bool ``include_A`` is True, if given). Unlike ``torch.bincount`` (which reads the maximum on
    the host to size its output), no device synchronisation."""
    ones_A = torch.ones_like(index_A) if include_A is None else include_A.long()
    return torch.zeros(size, dtype=torch.long, device=index_A.device).index_add_(0, index_A, ones_A)


def slot_pairs(expert_NK: Tensor) -> tuple[Tensor, Tensor]:
    """(token_A, slot_A) of the filled slots (expert id >= 0) of ``expert_NK``, token-major."""
    return (expert_NK >= 0).nonzero(as_tuple=True)


def slots_mask(expert_NK: Tensor, num_experts: int) -> Tensor:
    """bool [N, E]: the (token, expert) pairs named by ``expert_NK`` (-1 slots name none)."""
    token_A, slot_A = slot_pairs(expert_NK)
    mask_NE = torch.zeros(expert_NK.shape[0], num_experts, dtype=torch.bool, device=expert_NK.device)
    mask_NE[token_A, expert_NK[token_A, slot_A]] = True
    return mask_NE


def capacity_per_group(capacity_factor: float, group_size, top_k: int, num_experts: int):
    """C = ceil(capacity_factor * group_size * top_k / E), at least 1 and at most group_size
    (a token picks an expert at most once). ``capacity_factor=inf`` gives group_size.
    ``group_size`` is an int, or an int64 tensor of sizes (then elementwise)."""
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    if capacity_factor == math.inf:  # not math.isinf, which torch.compile cannot trace once it made the float symbolic
        return group_size
    if isinstance(group_size, Tensor):
        c = torch.ceil(capacity_factor * group_size.double() * top_k / num_experts).long()
        return torch.minimum(c.clamp_min(1), group_size)
    return max(1, min(group_size, math.ceil(capacity_factor * group_size * top_k / num_experts)))


def sort_into_segments(segment_A: Tensor, priority_A: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Sort by segment id, then by ascending priority within a segment (ties keep index order;
    deterministic: two stable sorts). Returns, in sorted order S: the permutation ``order_S``,
    ``is_start_S`` (first element of its segment) and ``rank_S`` (0-based rank in its segment)."""
    by_priority = torch.argsort(priority_A, stable=True)
    order_S = by_priority[torch.argsort(segment_A[by_priority], stable=True)]
    seg_S = segment_A[order_S]
    pos_S = torch.arange(order_S.numel(), device=order_S.device)
    is_start_S = torch.ones_like(seg_S, dtype=torch.bool)
    is_start_S[1:] = seg_S[1:] != seg_S[:-1]
    start_S = torch.cummax(torch.where(is_start_S, pos_S, torch.zeros_like(pos_S)), dim=0).values
    return order_S, is_start_S, pos_S - start_S


def rank_within_segments(segment_A: Tensor, priority_A: Tensor) -> Tensor:
    """int64 [A]: the 0-based rank of each element among those with the same segment id,
    ordered by ascending priority (ties keep index order)."""
    order_S, _, rank_S = sort_into_segments(segment_A, priority_A)
    rank_A = torch.empty_like(rank_S)
    rank_A[order_S] = rank_S
    return rank_A


# -- registry ---------------------------------------------------------------------------
_REGISTRY: dict[str, type[Router]] = {}


def register_router(name: str) -> Callable[[type[Router]], type[Router]]:
    """Class decorator: make a Router buildable by ``moe.build_router(name, ...)``."""

    def wrap(cls: type[Router]) -> type[Router]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"router name {name!r} is already registered to {_REGISTRY[name].__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def registered_routers() -> dict[str, type[Router]]:
    """Name -> class of every router registered so far (``moe.routers`` registers the built-in
    ones; ``moe.build_router`` builds by name)."""
    return dict(_REGISTRY)


SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
"""The router score functions of :func:`router_scores` (Megatron-Core's three)."""


def router_scores(logits_NE: Tensor, score: str) -> Tensor:
    """Router scores of one of :data:`SCORE_FUNCTIONS`: the softmax over the experts, or per
    expert the sigmoid or ``sqrt(softplus(logit))`` (Megatron-Core's "sqrtsoftplus" in
    ``topk_routing_with_score_function``, moe_utils.py). Row by row like
    :func:`softmax_or_sigmoid`: softplus is computed as ``logsumexp([x, 0])``, since
    ``F.softplus``'s vectorised CPU loop, like ``torch.sigmoid``'s, rounds a row differently
    with the number of rows in the call."""
    if score == "sqrtsoftplus":
        return torch.logsumexp(torch.stack([logits_NE, torch.zeros_like(logits_NE)], -1), dim=-1).sqrt()
    if score in ("softmax", "sigmoid"):
        return softmax_or_sigmoid(logits_NE, score)
    raise ValueError(f"score function must be one of {', '.join(map(repr, SCORE_FUNCTIONS))}, got {score!r}")


def softmax_or_sigmoid(logits_NE: Tensor, gate: str) -> Tensor:
    """Router scores. The sigmoid is computed as softmax([x, 0])[0], row by row, so that a
    token's score does not depend on how many tokens share the call: ``torch.sigmoid``'s
    vectorised CPU loop rounds the elements of its tail differently (by 1 ulp), which would
    make decoding a chunk differ from the full-sequence forward in the last bit."""
    if gate == "softmax":
        return F.softmax(logits_NE, dim=-1)
    if gate == "sigmoid":
        return F.softmax(torch.stack([logits_NE, torch.zeros_like(logits_NE)], -1), dim=-1)[..., 0]
    raise ValueError(f"gate must be 'softmax' or 'sigmoid', got {gate!r}")
