"""The logging section of a run, per-step training metrics (loss, aux loss, drops, router
entropy, expert loads, balance: MaxVio, dead experts, the tokens-per-expert spread, experts
per token), and how they are flattened for wandb and which wandb mode a run gets (the wandb run
itself is opened by ``moe.training.report``, which knows the whole TrainConfig)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moe.balance import active_experts_summary, balance_summary
from moe.checks import nonnegative_int
from moe.lm import ModelOutput
from moe.routing import Router


@dataclass
class LoggingConfig:
    """What a run reports and where."""

    log_every: int = 10
    """Print a log line every N steps (0 = never); the metrics JSONL gets every step."""
    metrics_jsonl: str | None = None
    """Write one JSON object per step here (rank 0)."""
    progress: bool = True
    """Show a progress bar (rank 0)."""
    wandb_project: str = "causal-moe-routing"
    """wandb project."""
    wandb_run_name: str | None = None
    """wandb run name (default: wandb's own)."""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """online | offline | disabled; default: $WANDB_MODE, else disabled for a run with no folder of its
    own (no --wandb-dir, --checkpoint-dir or --metrics-jsonl) or without wandb installed (the [wandb]
    extra), else online iff $WANDB_API_KEY is set, else offline."""
    wandb_dir: str | None = None
    """Directory for wandb's files (default: the run's own directory: ``checkpoint_dir``, else the
    metrics JSONL's directory, else the current directory when a wandb mode is asked for)."""

    def __post_init__(self) -> None:
        nonnegative_int("log_every", self.log_every)
        if self.wandb_mode not in (None, "online", "offline", "disabled"):
            raise ValueError(f"wandb_mode must be online, offline or disabled, got {self.wandb_mode!r}")


class RouterEntropy:
    """Per-token entropy (nats) of each router's softmax over experts, caught by forward hooks
    on the router gates; :meth:`pop` returns the sum and the count of the per-call means since
    the last call. Both are tensors on ``device`` updated in place, so a compiled block traces
    the hook once (a growing list would be a new guard, and a recompilation, at every call)."""

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu") -> None:
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.float64, device=device)
        self.handles = [m.gate.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, Router)]

    def _hook(self, module: nn.Module, inputs: tuple, logits_NE: Tensor) -> None:
        # experts-major: torch's CPU (log_)softmax over a short last dimension (E = 8 of N rows)
        # is slow; over the first dimension of the transposed copy this hook takes a third of
        # the time (40 against 119 us a call at N 768, docs/benchmarks.md)
        logp_EN = logits_NE.detach().float().t().contiguous().log_softmax(0)
        self.total += -(logp_EN.exp() * logp_EN).sum(0).mean().double().to(self.total.device)
        self.count += 1

    def pop(self) -> tuple[Tensor, Tensor]:
        out = (self.total.clone(), self.count.clone())
        self.total.zero_()
        self.count.zero_()
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class StepTally:
    """One training step's figures summed over its microbatches (and, with pipeline
    parallelism, over the MoE layers a rank holds); :meth:`finish` reduces them over all ranks.

    Shape legend: L MoE layers of the whole model, E experts."""

    def __init__(self, num_moe_layers: int, num_experts: int, device: torch.device) -> None:
        self.device = device
        # loss sum, losses, aux sum, microbatches, dropped-fraction sum, routings
        self.sums = torch.zeros(6, dtype=torch.float64, device=device)
        self.tokens_LE = torch.zeros(num_moe_layers, num_experts, dtype=torch.int64, device=device)
        self.active_LJ = torch.zeros(num_moe_layers, num_experts + 1, dtype=torch.int64, device=device)

    def add_loss(self, loss: Tensor) -> None:
        """The main (cross-entropy) loss of one microbatch."""
        self.sums[0] += loss.detach().double()
        self.sums[1] += 1

    def add_microbatches(self, n: int = 1) -> None:
        """Count n microbatch forwards of this rank (its aux losses are averaged over these)."""
        self.sums[3] += n

    def add_routing(
        self,
        layer: int,
        aux_loss: Tensor,
        dropped_fraction: Tensor,
        tokens_per_expert_E: Tensor,
        experts_per_token_J: Tensor,
    ) -> None:
        """MoE layer ``layer`` (0..L-1) of one microbatch forward; ``experts_per_token_J``
        (int [E + 1]): its tokens routed to 0, 1, ..., E experts."""
        self.sums[2] += aux_loss.detach().double().to(self.device)
        self.sums[4] += dropped_fraction.detach().double().to(self.device)
        self.sums[5] += 1
        self.tokens_LE[layer] += tokens_per_expert_E.to(self.device)
        self.active_LJ[layer] += experts_per_token_J.to(self.device)

    def add_output(self, out: ModelOutput) -> None:
        """A whole-model forward of one microbatch."""
        self.add_loss(out.loss)
        self.add_microbatches()
        for layer, r in enumerate(out.routings):
            self.add_routing(
                layer,
                r.aux_loss,
                r.stats["dropped_fraction"],
                r.stats["tokens_per_expert"],
                r.experts_per_token_histogram(),
            )

    def finish(self, entropy: tuple[Tensor, Tensor], pipeline_stages: int = 1) -> dict:
        """Loss (mean over microbatches and data-parallel ranks), aux loss (summed over layers,
        averaged likewise), dropped fraction and router entropy (means over layers, microbatches
        and ranks), per-layer expert loads (summed over ranks), and the balance figures of
        :mod:`moe.balance` from the whole step's counts (MaxVio_batch of the global batch).
        A collective over all ranks."""
        entropy_sum, entropy_n = entropy
        sums = torch.cat([self.sums, torch.stack([entropy_sum, entropy_n]).double().to(self.device)])
        tokens_LE, active_LJ = self.tokens_LE.clone(), self.active_LJ.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
            dist.all_reduce(tokens_LE)
            dist.all_reduce(active_LJ)
        loss_sum, loss_n, aux_sum, mb_n, dropped_sum, routings_n, ent_sum, ent_n = sums.tolist()
        load_LE = tokens_LE.double() / tokens_LE.sum(-1, keepdim=True).clamp_min(1)
        return {
            "loss": loss_sum / max(loss_n, 1.0),
            "aux_loss": aux_sum * pipeline_stages / max(mb_n, 1.0),
            "dropped_fraction": dropped_sum / routings_n if routings_n else 0.0,
            "router_entropy": ent_sum / ent_n if ent_n else 0.0,
            "tokens_per_expert": tokens_LE.tolist(),
            "expert_load": load_LE.tolist(),
            **balance_summary(tokens_LE.cpu()),
            **active_experts_summary(active_LJ.cpu()),
        }


def wandb_flat(record: dict) -> dict:
    """A metrics record as wandb scalars: per-expert load as ``load/layer{l}/expert{e}``, any
    other per-layer list ``name`` as ``name/layer{l}``, the experts-per-token histogram as
    ``active_experts_hist/{j}``."""
    flat = {}
    for k, v in record.items():
        if k in ("step", "tokens_per_expert"):
            continue
        if k == "expert_load":
            flat.update(
                {f"load/layer{layer}/expert{e}": x for layer, load_E in enumerate(v) for e, x in enumerate(load_E)}
            )
        elif k.endswith("active_experts_hist"):
            flat.update({f"{k}/{j}": x for j, x in enumerate(v)})
        elif isinstance(v, list):
            flat.update({f"{k}/layer{layer}": x for layer, x in enumerate(v)})
        else:
            flat[k] = v
    return flat


def resolve_wandb_mode(requested: str | None, run_dir: str | None) -> str:
    """The mode asked for, else $WANDB_MODE. Unasked, wandb is opt-in: disabled for a run with no
    folder of its own (``run_dir`` None: nothing is written into the working directory) or
    without wandb installed (the ``[wandb]`` extra); else online iff $WANDB_API_KEY is set, else
    offline. Offline and disabled never touch the network; online is only chosen with a key (no prompt)."""
    asked = requested or os.environ.get("WANDB_MODE")
    if asked:
        return asked
    if run_dir is None or importlib.util.find_spec("wandb") is None:
        return "disabled"
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"
