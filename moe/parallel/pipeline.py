"""Pipeline parallelism for :class:`~moe.model.MoETransformer` with
``torch.distributed.pipelining``: the model cut into stages, each stage's MoE auxiliary losses
injected into its own backward, and the schedules PyTorch ships (GPipe, 1F1B, interleaved 1F1B).

Shape legend: B batch (a rank's share of the global batch), b = B/M a microbatch, T sequence,
D model width, V vocabulary, S pipeline ranks, K = S*V stages (V virtual stages per rank),
M microbatches, L MoE layers, E experts.

**Stages.** The N blocks are cut into K contiguous stages (:func:`split_blocks`); stage k runs
on pipeline rank k mod S (V = 1 except for interleaved 1F1B). Stage 0 also embeds the tokens,
stage K-1 also applies the final norm and the output projection. A rank's parameters live in
one :class:`StageModel` whose parameter names are those of the whole model (``blocks.3.attn...``),
so a checkpoint written under any pipeline layout loads into any other and into one process.
With tied embeddings the last stage keeps the embedding module too (unused in its forward: it
only names the shared weight ``embed.weight``, as in the whole model); the two copies of that
weight, on the first and last ranks, get the sum of their gradients (:meth:`StageModel.sync_tied`)
and stay equal because both apply the same update.

**Auxiliary losses without crossing stages.** A stage's routers produce their load-balancing
and z-losses in its forward, but only the last stage has a loss to call backward on. After
every MoE block the stage passes its activations through :class:`AuxLossInjector`, an identity
in forward whose backward adds d(aux)/d(aux) = 1 to the aux loss's graph, so the gradient of
``loss + aux`` flows through the stage's own backward and no loss value is ever sent. The
schedule divides every gradient by M after the last backward (``scale_grads``), exactly as it
does for the main loss: the step's gradient is that of mean over microbatches of
(loss_m + aux_m), which is what one process accumulating the same M microbatches computes.

**Router statistics.** Routers accumulate their statistics (expert loads for the aux-loss-free
bias, expert-choice cut-offs for ``ec_threshold``) over every microbatch forward of the step;
the loop averages them over the stage's data-parallel ranks and calls ``update_routers`` on the
stage once per step, so each stage updates from the whole step's counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from moe.checks import positive_int
from moe.lm import lm_loss
from moe.parallel.exchange import guarded
from moe.routing import Router, Routing

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B}
"""Schedule name -> ``torch.distributed.pipelining`` schedule class."""


def virtual_stages(schedule: str) -> int:
    """V: stages per pipeline rank the schedule runs (2 for interleaved 1F1B, else 1)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    return 2 if schedule == "interleaved1f1b" else 1


def split_blocks(n_layers: int, num_stages: int) -> list[list[int]]:
    """The block indices of each of ``num_stages`` contiguous stages, sizes differing by at most
    one (earlier stages take the extra blocks: the last stage also runs the output projection)."""
    positive_int("num_stages", num_stages)
    if n_layers < num_stages:
        raise ValueError(f"{num_stages} pipeline stages need at least {num_stages} blocks, the model has {n_layers}")
    base, extra = divmod(n_layers, num_stages)
    out, start = [], 0
    for k in range(num_stages):
        size = base + (1 if k < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def bubble_fraction(num_ranks: int, microbatches: int) -> float:
    """Idle fraction of a GPipe or 1F1B step with equal stage times: (S-1)/(M+S-1); for
    interleaved 1F1B with V stages per rank pass V*M microbatches, (S-1)/(V*M+S-1)."""
    return (num_ranks - 1) / (microbatches + num_ranks - 1)


class AuxLossInjector(torch.autograd.Function):
    """``x_out = AuxLossInjector.apply(x, aux)``: x unchanged in forward; in backward, x's
    gradient passes through and ``aux`` receives gradient 1, as if ``aux`` had been added to
    the loss whose gradient reaches x_out."""

    @staticmethod
    def forward(ctx, x: Tensor, aux: Tensor) -> Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x: Tensor) -> tuple[Tensor, Tensor]:
        shape, dtype, device = ctx.aux_meta
        return grad_x, torch.ones(shape, dtype=dtype, device=device)


@dataclass
class LayerRecord:
    """What one MoE block's routing contributed to one microbatch forward (detached)."""

    layer: int
    """Index among the model's MoE blocks (0..L-1)."""
    aux_loss: Tensor
    dropped_fraction: Tensor
    tokens_per_expert: Tensor
    """int [E]."""
    experts_per_token_histogram: Tensor
    """int [E + 1]: tokens routed to 0, 1, ..., E experts."""


class _StagePart(nn.Module):
    """The forward of a run of consecutive blocks; registers the modules it uses (shared with
    the :class:`StageModel` that owns them) so its ``parameters()`` are exactly its own. The
    forward is the whole model's own pieces (``embed_tokens``, ``forward_blocks``,
    ``output_logits`` of the model's class) called on this part."""

    def __init__(self, owner: StageModel, blocks: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.cfg, self.lm = owner.cfg, owner.lm
        self.first, self.last = first, last
        self.embed = owner.embed if first else None
        self.blocks = nn.ModuleDict({str(i): owner.blocks[str(i)] for i in blocks})
        self.norm = owner.norm if last else None
        self.head = owner.head if last else None
        self._owner = [owner]  # a list: not registered, so no parameter is named twice

    def forward(self, x: Tensor, cache=None) -> Tensor:
        """Token ids [b, T] (first stage) or activations [b, T, D] -> activations, or logits
        [b, T, V] (last stage); ``cache`` a ``moe.lm.KVCache`` when decoding. In training mode
        every MoE block's aux loss is injected into the backward and its routing recorded
        (:meth:`StageModel.pop_records`)."""
        owner = self._owner[0]

        def inject(x: Tensor, layer: int, routing: Routing) -> Tensor:
            if torch.is_grad_enabled() and routing.aux_loss.requires_grad:
                x = AuxLossInjector.apply(x, routing.aux_loss)
            if self.training and cache is None and x.device.type != "meta":
                owner.records.append(
                    LayerRecord(
                        owner.moe_index[layer],
                        routing.aux_loss.detach().float(),
                        routing.stats["dropped_fraction"].detach().float(),
                        routing.stats["tokens_per_expert"].detach(),
                        routing.experts_per_token_histogram(),
                    )
                )
            return x

        if self.first:
            x = self.lm.embed_tokens(self, x, cache)
        x = self.lm.forward_blocks(self, x, cache, inject)
        return self.lm.output_logits(self, x) if self.last else x


class StageModel(_StagePart):
    """The part of a model one pipeline rank holds: the blocks of its stages, the embedding on
    the first rank (and on the last with tied embeddings), the final norm and head on the last;
    parameter names as in the whole model. ``parts`` are the rank's stages (modules to hand to
    ``PipelineStage``, in stage order): the model itself when it holds one stage."""

    def __init__(self, model: nn.Module, rank: int, num_ranks: int, virtual: int = 1) -> None:
        """``model``: a ``moe.model.MoETransformer`` (its modules are shared, not copied)."""
        nn.Module.__init__(self)
        cfg = model.cfg
        self.cfg = cfg
        self.lm = type(model)
        """The model's class, whose forward pieces every part calls on itself."""
        self.num_stages = num_ranks * virtual
        split = split_blocks(cfg.n_layers, self.num_stages)
        self.stage_ids = [rank + v * num_ranks for v in range(virtual)]
        owned = [i for k in self.stage_ids for i in split[k]]
        self.has_first = 0 in self.stage_ids
        self.has_last = self.num_stages - 1 in self.stage_ids
        self.tied = cfg.tie_embeddings
        self.embed = model.embed if self.has_first or (self.has_last and self.tied) else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in owned})
        self.norm = model.norm if self.has_last else None
        self.head = model.head if self.has_last else None
        moe_layers = [i for i in range(cfg.n_layers) if cfg.is_moe_block(i)]
        self.moe_index = {i: n for n, i in enumerate(moe_layers)}
        self.num_moe_layers = len(moe_layers)
        self.records: list[LayerRecord] = []
        self.first, self.last = self.has_first, self.has_last
        self._owner = [self]
        if virtual == 1:
            self.parts = [self]
        else:
            self.parts = [_StagePart(self, split[k], k == 0, k == self.num_stages - 1) for k in self.stage_ids]

    def pop_records(self) -> list[LayerRecord]:
        """The routings recorded since the last call (one per MoE block per microbatch forward)."""
        out, self.records = self.records, []
        return out

    def tied_weight(self) -> nn.Parameter | None:
        """The embedding weight shared by the first and last stage (None unless tied and this
        rank holds one of them but not both)."""
        if not self.tied or self.has_first == self.has_last:
            return None
        return self.embed.weight if self.has_first else self.head.weight

    def uncounted(self) -> tuple:
        """Parameters a gradient norm over the stages must not count on this rank: the last
        stage's copy of a tied embedding (the first stage counts it)."""
        return (self.head.weight,) if self.tied_weight() is not None and self.has_last else ()

    def routers(self) -> list[Router]:
        """The router of every MoE block this rank holds, in block order."""
        return [m for m in self.modules() if isinstance(m, Router)]


def tied_groups(num_ranks: int, data_parallel: int, stage_rank_of) -> dict[int, dist.ProcessGroup]:
    """For tied embeddings over ``num_ranks`` > 1 pipeline ranks: data-parallel index -> the
    process group of the first and the last pipeline rank holding that index (every rank must
    call this: ``new_group`` is a collective). ``stage_rank_of(pp, dp)`` is the global rank."""
    groups = {}
    for d in range(data_parallel):
        groups[d] = dist.new_group([stage_rank_of(0, d), stage_rank_of(num_ranks - 1, d)])
    return groups


def sync_tied_gradient(weight: nn.Parameter | None, group) -> None:
    """Sum the gradient of the tied embedding weight over its two holders (both hold partial
    gradients: the lookup on the first stage, the output projection on the last)."""
    if weight is None or weight.grad is None:
        return
    grad = weight.grad
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    guarded("tied-embedding gradient all-reduce", group, lambda: dist.all_reduce(local, group=group))


class Pipeline:
    """One training step of a :class:`StageModel` through a pipeline schedule. Every rank of
    the pipeline group calls :meth:`step` with its data-parallel share of the batch."""

    def __init__(
        self,
        stage_model: StageModel,
        schedule: str,
        microbatches: int,
        microbatch_shape: tuple[int, int],
        group,
        device: torch.device,
        logits_dtype: torch.dtype = torch.float32,
    ) -> None:
        positive_int("microbatches", microbatches)
        cls = SCHEDULES[schedule]
        ranks = stage_model.num_stages // len(stage_model.parts)
        if cls is not ScheduleGPipe and microbatches < ranks:
            raise ValueError(
                f"{schedule} needs at least as many microbatches as pipeline ranks ({ranks}), "
                f"got microbatches={microbatches}"
            )
        if cls is ScheduleInterleaved1F1B and microbatches % ranks:
            raise ValueError(
                f"interleaved1f1b needs microbatches divisible by the pipeline ranks ({ranks}), got {microbatches}"
            )
        self.model, self.microbatches = stage_model, microbatches
        b, t = microbatch_shape
        cfg, last = stage_model.cfg, stage_model.num_stages - 1

        def meta(*shape, dtype=torch.float32) -> Tensor:
            # activations carry gradients: the receiving stage computes its input's gradient
            return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)

        # Every shape is known, so the stages skip PyTorch's shape inference (a forward on meta
        # tensors that would run the routers once more than the schedule does).
        stages = [
            PipelineStage(
                part,
                k,
                stage_model.num_stages,
                device,
                group=group,
                input_args=meta(b, t, dtype=torch.long) if k == 0 else meta(b, t, cfg.d_model),
                output_args=meta(b, t, cfg.vocab_size, dtype=logits_dtype) if k == last else meta(b, t, cfg.d_model),
            )
            for part, k in zip(stage_model.parts, stage_model.stage_ids)
        ]
        self.stages = stages
        """The ``PipelineStage`` of each of this rank's stages."""
        if cls is ScheduleInterleaved1F1B:
            self.schedule = cls(stages, microbatches, loss_fn=lm_loss)
        else:
            self.schedule = cls(stages[0], microbatches, loss_fn=lm_loss)

    def step(self, idx_BT: Tensor, targets_BT: Tensor) -> list[Tensor]:
        """Forward and backward of the M microbatches of (idx, targets); gradients left in the
        stage's parameters (scaled as the mean over microbatches). Returns the last stage's
        per-microbatch losses (empty on other ranks)."""
        if idx_BT.shape[0] % self.microbatches:
            raise ValueError(
                f"a rank's batch of {idx_BT.shape[0]} sequences does not split into "
                f"{self.microbatches} equal microbatches"
            )
        losses: list[Tensor] = []
        args = (idx_BT,) if self.model.has_first else ()
        target = targets_BT if self.model.has_last else None
        self.schedule.step(*args, target=target, losses=losses if self.model.has_last else None)
        return losses
