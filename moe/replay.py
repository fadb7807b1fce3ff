"""Record the routing of some forwards, and route later forwards with it (routing replay).

    with moe.record_routing(model) as record:      # e.g. while generating with the KV cache
        seq = model.generate(prompt, 64)
    with moe.replay_routing(model, record):        # the training forward of the same tokens
        out = model(seq[:, :-1], seq[:, 1:])       # routes each token to its recorded experts
        (out.loss + out.aux_loss).backward()       # the gates still get gradients

This is Rollout Routing Replay (R3, arXiv 2510.11370; Megatron-Core's ``RouterReplay``,
``moe_enable_routing_replay``): a reinforcement-learning trainer computes its forward with the
experts the inference engine served, so that a precision, batch or kernel difference between
the two cannot flip a routing decision between sampling and training. Every router of the
package replays (``Router.replay``): the recorded (token, expert) pairs are used whatever the
gates now say, with the combine weights that router's formula gives them from the current
scores. With the weights unchanged since recording, a replayed forward equals the recorded one
bit for bit (outputs, aux losses, gradients).

Both work through each router's ``context.routing_hook`` (:class:`moe.routing.RouterContext`): each router of ``model`` (in module order: the
record's layer index) gets a tap while a context runs. A forward without a decode state is
positions 0..T-1 of its B sequences; a forward with one (a KV-cache chunk) the next T positions
from the state's position. Under expert parallelism each rank records and replays its own
tokens (routing happens before the exchange). A transformers model generates through
``moe.integrations.hf.decoding``, which gives each router its position; a generation that runs
past ``max_seq_len`` re-forwards a cropped window from position 0 and cannot be recorded as one
sequence. Under activation checkpointing the backward reruns block forwards: run it inside
``replay_routing`` too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from moe.record import RoutingRecord, routing_slots
from moe.record_fit import check_record_fits
from moe.routing import DecodeState, Router, Routing


class RoutingTap:
    """The ``context.routing_hook`` of one router while :func:`record_routing` or :func:`replay_routing` run."""

    def __init__(self, router: Router, layer: int) -> None:
        self.router = router
        self.layer = layer
        self.records: list[RoutingRecord] = []
        """Records being filled (one per open ``record_routing``)."""
        self.source: RoutingRecord | None = None
        """The record being replayed, if any."""

    def __call__(
        self, logits_NE: Tensor, x_BTD: Tensor, batch_shape: tuple[int, int], decode_state: DecodeState | None
    ) -> Routing:
        position = 0 if decode_state is None else decode_state.position
        if self.source is None:
            routing = self.router.route_tokens(logits_NE, x_BTD, batch_shape, decode_state)
        else:
            expert_NK = self.source.choices(self.layer, batch_shape, position).to(logits_NE.device)
            routing = self.router.replay(logits_NE, x_BTD, batch_shape, expert_NK, decoding=decode_state is not None)
        if self.records:
            slots_NK = routing_slots(routing)
            for record in self.records:
                record.write(self.layer, slots_NK, batch_shape, position)
        return routing


def model_routers(model: nn.Module, draft: nn.Module | None = None) -> list[Router]:
    """The routers of ``model`` in module order (a record's layers), except those inside ``draft``
    (a draft or multi-token-prediction module, whose routing is not the target's); ValueError if
    there is none."""
    skipped = set() if draft is None else {id(m) for m in draft.modules()}
    routers = [m for m in model.modules() if isinstance(m, Router) and id(m) not in skipped]
    if not routers:
        raise ValueError(f"{type(model).__name__} has no router: nothing to record or replay")
    return routers


def _taps(routers: list[Router]) -> list[RoutingTap]:
    taps = []
    for layer, router in enumerate(routers):
        tap = router.context.routing_hook
        if tap is None:
            tap = RoutingTap(router, layer)
        elif not isinstance(tap, RoutingTap) or tap.layer != layer:
            raise ValueError(
                f"router {layer} ({type(router).__name__}) already has another routing_hook: record and replay "
                "the same model, not a part of it inside another"
            )
        taps.append(tap)
    for router, tap in zip(routers, taps):
        router.context.routing_hook = tap
    return taps


def _release(taps: list[RoutingTap]) -> None:
    for tap in taps:
        if not tap.records and tap.source is None:
            tap.router.context.routing_hook = None


@contextmanager
def record_routing(
    model: nn.Module, prefix: RoutingRecord | None = None, draft: nn.Module | None = None
) -> Iterator[RoutingRecord]:
    """Record the routing of every forward of ``model`` inside the block into the yielded
    :class:`~moe.record.RoutingRecord` (one batch of sequences; see :mod:`moe.record`). Recording
    reads each routing's largest number of experts per token on the host (one synchronisation
    per MoE layer and forward).

    ``prefix``: the record of positions 0..P-1 already routed (a prompt prefilled into the KV
    cache before, a cached prefix): the record starts from it, so a forward may begin at position
    P. ``draft``: a submodule whose routers are not recorded (a draft or MTP module)."""
    routers = model_routers(model, draft)
    num_experts = [r.num_experts for r in routers]
    record = RoutingRecord(len(routers), None if prefix is None else prefix.experts, num_experts)
    taps = _taps(routers)
    for tap in taps:
        tap.records.append(record)
    try:
        yield record
    finally:
        for tap in taps:
            tap.records.remove(record)
        _release(taps)


@contextmanager
def replay_routing(model: nn.Module, record: RoutingRecord, draft: nn.Module | None = None) -> Iterator[None]:
    """Route every forward of ``model`` inside the block with ``record``'s experts: each
    router's ``replay`` (the recorded pairs, that router's combine weights from the current
    scores). A record that does not fit the model is refused naming what does not fit
    (:mod:`moe.record_fit`: layers, experts, a duplicated expert, more or fewer experts per token
    than the router routes; fewer than a capacity router's ``top_k`` is replayed with a warning).
    A forward must route sequences and positions the record holds (ValueError otherwise: its
    batch size, or positions past its length). A ``record_routing`` open at the same time
    records the replayed routing. ``draft``: a submodule whose routers route by their own gates
    (not in the record)."""
    routers = model_routers(model, draft)
    if not isinstance(record, RoutingRecord):
        raise ValueError(f"replay_routing needs a moe.RoutingRecord, got {type(record).__name__}")
    check_record_fits(record.experts, record.num_experts, routers, record.padding)
    taps = _taps(routers)
    if any(tap.source is not None for tap in taps):
        _release(taps)
        raise ValueError("replay_routing is already running on this model")
    for tap in taps:
        tap.source = record
    try:
        yield
    finally:
        for tap in taps:
            tap.source = None
        _release(taps)
