"""The global-batch load-balancing loss over a step cut into microbatches.

Shape legend: X columns of a router's probabilities (E experts, or E plus null experts).

A router's global balance loss (``global_aux_loss_coef``, :meth:`moe.routing.Router._aux_loss`;
Megatron-Core's ``global_aux_loss``, arXiv 2501.11873) counts f, the fraction of the
assignments each expert got, over the step's whole batch: every microbatch of every
data-parallel rank. When a step is one forward, that forward's counts summed over the
router's ``context.stats_group`` are those counts. When it is M > 1 microbatches, the first
microbatch's loss (and its backward, before the second microbatch runs) would need counts
that do not exist yet. Megatron-Core (``TopKRouter._apply_global_aux_loss``) lets microbatch i
use the running mean of the counts of microbatches 1..i, so the loss, and the trained model,
change with M. Here :func:`global_batch_loads` first routes every microbatch in a forward
without gradients, sums the counts over the microbatches and the ``stats_group``, and hands
them to the routers for the step's real forwards: the losses and gradients are those of one
process forwarding the whole batch at once, for any M and any data-parallel degree, at the
cost of one extra forward (no backward) of the batch per step.

The counting forwards change no router state: every buffer of every router (loads seen by
the aux-loss-free bias, pending threshold statistics, ...) is put back as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from moe.routing import Router


def global_balance_routers(model: nn.Module) -> list[Router]:
    """The routers of ``model`` with a global balance loss (``global_aux_loss_coef > 0``)."""
    return [m for m in model.modules() if isinstance(m, Router) and m.global_aux_loss_coef > 0]


@contextmanager
def global_batch_loads(model: nn.Module, forwards: Sequence[Callable[[], object]]) -> Iterator[None]:
    """Inside the block, every router of ``model`` with a global balance loss reads the
    assignment counts of the whole step: ``forwards`` (one callable per microbatch, each
    running ``model`` on it as the step will) are first run without gradients to count them,
    and the counts are summed over each router's ``context.stats_group``. With one forward (or no such
    router) nothing is run: the step's single forward counts for itself. A collective when the
    routers share statistics: every rank enters with the same number of microbatches."""
    routers = global_balance_routers(model)
    if len(forwards) <= 1 or not routers:
        yield
        return
    every_router = [m for m in model.modules() if isinstance(m, Router)]
    saved = [[b.detach().clone() for b in r.buffers(recurse=False)] for r in every_router]
    try:
        for r in routers:
            r.context.global_load = None
            r.context.load_counter = torch.zeros((), dtype=torch.float64, device=r.gate.weight.device)  # grows to [X]
        with torch.no_grad():
            for forward in forwards:
                forward()
        for r, buffers in zip(every_router, saved):
            with torch.no_grad():
                for b, old in zip(r.buffers(recurse=False), buffers):
                    b.copy_(old)
        for r in routers:
            load = r.context.load_counter
            if r.context.stats_group is not None:
                torch.distributed.all_reduce(load, group=r.context.stats_group)
            r.context.global_load, r.context.load_counter = load, None
        yield
    finally:
        for r in routers:
            r.context.global_load = r.context.load_counter = None
