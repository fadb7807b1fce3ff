"""The routers of MoE training frameworks, each in the configurations that change its causality.

Shape legend: B batch, T sequence, S = B * T flattened tokens, D hidden size, E experts,
K experts per token, C capacity slots per expert.

Every target maps x_BTD to the dense combine weights w_BTE the framework's own routing code
produces (zero where a token is not routed or was dropped), flattening tokens the way the
framework's MoE layer does: Megatron-Core's layers see [T, B, D] (token s = t * B + b),
DeepSpeed's and fairscale's MoE layers reshape [B, T, D] to [B * T, D] (token s = b * T + t),
torchtitan's router keeps [B, T, D]. The gate weights are seeded N(0, 1 / D)
(:func:`~moe.audit.zoo.build.init_parameters`); capacities are the frameworks' own formulas
at the zoo's shape (B=2, T=8, D=16, E=4, K=2: 16 tokens).

Install the frameworks without letting pip touch torch (``pip install -e '.[zoo-frameworks]'``
or ``pip install --no-deps megatron-core deepspeed fairscale torchtitan`` plus their small
import-time dependencies); each is imported lazily, only by the configurations that use it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.audit.zoo.build import D_MODEL, EXPERTS, TOP_K, init_parameters


@dataclass(frozen=True)
class FrameworkConfig:
    """One framework router in one configuration."""

    library: str
    """Its PyPI distribution, e.g. "megatron-core"."""
    name: str
    """What is audited and how configured, e.g. "TopKRouter.routing cf=1 drop_policy=probs"."""
    router_kind: str
    """What its routing code does (read from the code)."""
    capacity: str | None
    """The capacity settings (None: dropless)."""
    train_noise: str | None
    """What makes it random, and in which mode (None: nothing)."""
    make: Callable[[], nn.Module]
    """A fresh initialised target x_BTD -> w_BTE (imports the framework)."""
    note: str | None = None
    """How the audited code was reached when the framework's own module cannot run here."""

    @property
    def module(self) -> str:
        return _IMPORT_NAME[self.library]


_IMPORT_NAME = {
    "megatron-core": "megatron.core",
    "deepspeed": "deepspeed",
    "fairscale": "fairscale",
    "torchtitan": "torchtitan",
}
"""The package each distribution installs."""


def unavailable(library: str) -> str | None:
    """Why ``library`` cannot be used (None: it imports): not installed, or installed but failing
    to import, with the error (a requirement of its own missing, as deepspeed's einops)."""
    try:
        importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return f"{library} is not installed (pip install --no-deps {library}; see moe.audit.zoo.frameworks)"
    try:
        importlib.import_module(_IMPORT_NAME[library])
    except Exception as e:  # broken by a missing dependency: the row says which
        return f"{library} is installed but cannot be imported ({type(e).__name__}: {e}; docs/zoo.md gives its needs)"
    return None


def _dense(ids_BTK: Tensor, weights_BTK: Tensor) -> Tensor:
    b, t, _ = ids_BTK.shape
    return torch.zeros(b, t, EXPERTS, dtype=weights_BTK.dtype).scatter(-1, ids_BTK, weights_BTK)


# -- Megatron-Core ---------------------------------------------------------------------------------
class MegatronRouting(nn.Module):
    """``TopKRouter.routing`` step by step with Megatron's own functions
    (``topk_routing_with_score_function``, then ``apply_router_token_dropping`` when a capacity
    factor is set) on logits x @ W^T over [T, B, D], as ``TopKRouter.gating`` computes them. With
    ``aux_loss_coeff``, training attaches the Switch load-balancing loss
    (``switch_load_balancing_loss_func``) to the probabilities with ``MoEAuxLossAutoScaler``, as
    ``TopKRouter.aux_loss_load_balancing`` does: the loss gets its gradient in backward."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(EXPERTS, D_MODEL))
        self.capacity_factor = options.pop("capacity_factor", None)
        self.drop_policy = options.pop("drop_policy", "probs")
        self.pad_to_capacity = options.pop("pad_to_capacity", False)
        expert_bias = options.pop("expert_bias", None)
        self.register_buffer("expert_bias", None if expert_bias is None else torch.tensor(expert_bias))
        self.aux_loss_coeff = options.pop("aux_loss_coeff", None)
        self.options = options

    def forward(self, x_BTD: Tensor) -> Tensor:
        from megatron.core.transformer.moe import moe_utils

        b, t, _ = x_BTD.shape
        logits_SE = F.linear(x_BTD.transpose(0, 1), self.weight).reshape(t * b, EXPERTS)
        probs_SE, map_SE = moe_utils.topk_routing_with_score_function(
            logits_SE, TOP_K, expert_bias=self.expert_bias, **self.options
        )
        if self.capacity_factor is not None:
            probs_SE, map_SE = moe_utils.apply_router_token_dropping(
                probs_SE, map_SE, TOP_K, self.capacity_factor, self.drop_policy, self.pad_to_capacity
            )
        if self.aux_loss_coeff is not None and self.training:
            scores_SE = torch.softmax(logits_SE, dim=-1)
            aux = moe_utils.switch_load_balancing_loss_func(
                scores_SE, map_SE.sum(0), t * b, TOP_K, EXPERTS, self.aux_loss_coeff
            )
            probs_SE = moe_utils.MoEAuxLossAutoScaler.apply(probs_SE, aux)
        return (probs_SE * map_SE).reshape(t, b, EXPERTS).transpose(0, 1)


def _megatron(name: str, kind: str, capacity: str | None, **options: Any) -> FrameworkConfig:
    return FrameworkConfig(
        "megatron-core",
        f"TopKRouter.routing {name}",
        kind,
        capacity,
        None,
        lambda: init_parameters(MegatronRouting(**options)),
        note="its routing functions on logits computed as TopKRouter.gating does (gating moves the weights to CUDA)",
    )


MEGATRON_CAPACITY = "C = ceil(S * K / E * cf) over the T * B tokens of the micro-batch"
MEGATRON = [
    _megatron("top-2 softmax, dropless", "softmax top-k of the token's logits", None, score_function="softmax"),
    _megatron(
        "top-2 softmax, dropless, aux loss",
        "softmax top-k; in training the Switch loss over the micro-batch attached by MoEAuxLossAutoScaler",
        None,
        score_function="softmax",
        aux_loss_coeff=0.01,
    ),
    _megatron(
        "top-2 sigmoid + expert_bias, 2 groups (group_topk=1), dropless",
        "sigmoid + expert_bias top-k inside the token's best group",
        None,
        score_function="sigmoid",
        num_groups=2,
        group_topk=1,
        expert_bias=[0.5, -0.5, 0.25, 0.0],
    ),
    _megatron(
        "top-2 cf=1 drop_policy=probs",
        "softmax top-k; each expert keeps its C highest-probability tokens (topk over dim 0)",
        f"cf=1.0: {MEGATRON_CAPACITY}",
        capacity_factor=1.0,
        drop_policy="probs",
    ),
    _megatron(
        "top-2 cf=1 drop_policy=probs pad_to_capacity",
        "as drop_policy=probs, the expert input padded to C",
        f"cf=1.0: {MEGATRON_CAPACITY}",
        capacity_factor=1.0,
        drop_policy="probs",
        pad_to_capacity=True,
    ),
    _megatron(
        "top-2 cf=1 drop_policy=position",
        "softmax top-k; each expert keeps C routed tokens chosen by torch.topk over the 0/1 routing map (ties)",
        f"cf=1.0: {MEGATRON_CAPACITY}",
        capacity_factor=1.0,
        drop_policy="position",
    ),
    _megatron(
        "top-2 cf=2.5 drop_policy=probs",
        "capacity above the token count: apply_router_token_dropping keeps every token",
        f"cf=2.5: C = 20 > 16 tokens ({MEGATRON_CAPACITY})",
        capacity_factor=2.5,
        drop_policy="probs",
    ),
]


# -- DeepSpeed -------------------------------------------------------------------------------------
class CombineWeights(nn.Module):
    """A GShard-style gate on the flattened [B * T, D] tokens (as the framework's MOELayer
    reshapes them), its combine weights [S, E, C] summed over the slots."""

    def __init__(self, gate: nn.Module) -> None:
        super().__init__()
        self.gate = gate

    def forward(self, x_BTD: Tensor) -> Tensor:
        b, t, d = x_BTD.shape
        combine_SEC = self.gate(x_BTD.reshape(b * t, d))[1]
        return combine_SEC.sum(-1).reshape(b, t, -1)


def _deepspeed(name: str, kind: str, capacity: str | None, noise: str | None, **options: Any) -> FrameworkConfig:
    def make() -> nn.Module:
        from deepspeed.moe.sharded_moe import TopKGate

        return init_parameters(CombineWeights(TopKGate(D_MODEL, EXPERTS, **options)))

    return FrameworkConfig("deepspeed", f"TopKGate {name}", kind, capacity, noise, make)


DS_CAPACITY = "C = max(ceil(S / E * cf * K), min_capacity=1) over the B * T tokens"
DEEPSPEED = [
    _deepspeed(
        "k=1 cf=1 use_rts (default)",
        "top1gating: argmax; each expert keeps C tokens of highest uniform random priority (random token selection)",
        f"cf=1.0: {DS_CAPACITY}",
        "uniform priorities for RTS (both modes)",
        k=1,
        capacity_factor=1.0,
        eval_capacity_factor=1.0,
        min_capacity=1,
    ),
    _deepspeed(
        "k=1 cf=1 use_rts=False",
        "top1gating: argmax; each expert keeps C tokens chosen by torch.topk over the 0/1 mask (ties)",
        f"cf=1.0: {DS_CAPACITY}",
        None,
        k=1,
        capacity_factor=1.0,
        eval_capacity_factor=1.0,
        min_capacity=1,
        use_rts=False,
    ),
    _deepspeed(
        "k=1 drop_tokens=False",
        "top1gating: argmax; capacity = the largest expert count, nothing dropped",
        None,
        None,
        k=1,
        drop_tokens=False,
        min_capacity=1,
    ),
    _deepspeed(
        "k=2 cf=1",
        "top2gating: second choices queued after every first choice (locations2 += sum(mask1)), cumsum over B * T",
        f"cf=1.0: {DS_CAPACITY}",
        "Gumbel-sampled second expert (top2_2nd_expert_sampling, both modes)",
        k=2,
        capacity_factor=1.0,
        eval_capacity_factor=1.0,
        min_capacity=1,
    ),
    _deepspeed(
        "k=2 cf=1 train, eval_capacity_factor=4",
        "top2gating; in eval the capacity covers every token",
        f"train cf=1.0, eval cf=4.0: {DS_CAPACITY}",
        "Gumbel-sampled second expert (both modes)",
        k=2,
        capacity_factor=1.0,
        eval_capacity_factor=4.0,
        min_capacity=1,
    ),
    _deepspeed(
        "k=2 drop_tokens=False",
        "top2gating: capacity = the largest expert count, nothing dropped",
        None,
        "Gumbel-sampled second expert (both modes)",
        k=2,
        drop_tokens=False,
        min_capacity=1,
    ),
    _deepspeed(
        "k=3 cf=1 (topkgating, drop_policy=probs)",
        "topkgating: each expert keeps its C highest gates over the B * T tokens (topk over dim 0)",
        f"cf=1.0: {DS_CAPACITY}",
        None,
        k=3,
        capacity_factor=1.0,
        eval_capacity_factor=1.0,
        min_capacity=1,
    ),
]


# -- fairscale -------------------------------------------------------------------------------------
def _fairscale_make() -> nn.Module:
    from fairscale.nn.moe.top2gate import Top2Gate

    return init_parameters(CombineWeights(Top2Gate(D_MODEL, EXPERTS)))


FAIRSCALE = [
    FrameworkConfig(
        "fairscale",
        "Top2Gate",
        "top2gating: second choices queued after every first choice (locations2 += sum(mask1)), cumsum over B * T",
        "C = 2 * S // E (fixed), S % E == 0 asserted",
        "Gumbel-sampled second expert (both modes: no training check)",
        _fairscale_make,
    )
]


# -- torchtitan ------------------------------------------------------------------------------------
class TitanRouter(nn.Module):
    """torchtitan's ``TokenChoiceTopKRouter`` on [B, T, D], with the MoE layer's load-balancing
    ``expert_bias_E`` buffer set as if learned (it is updated outside the forward)."""

    def __init__(self, expert_bias: list[float] | None = None, **options: Any) -> None:
        super().__init__()
        from torchtitan.models.common.linear import Linear
        from torchtitan.models.common.moe import TokenChoiceTopKRouter

        gate = Linear.Config(in_features=D_MODEL, out_features=EXPERTS, bias=False)
        self.router = TokenChoiceTopKRouter.Config(num_experts=EXPERTS, gate=gate, top_k=TOP_K, **options).build()
        self.register_buffer("expert_bias_E", None if expert_bias is None else torch.tensor(expert_bias))

    def forward(self, x_BTD: Tensor) -> Tensor:
        scores_BTK, ids_BTK, _ = self.router(x_BTD, self.expert_bias_E)
        return _dense(ids_BTK, scores_BTK)


def _titan(name: str, kind: str, **options: Any) -> FrameworkConfig:
    return FrameworkConfig(
        "torchtitan", f"TokenChoiceTopKRouter {name}", kind, None, None, lambda: init_parameters(TitanRouter(**options))
    )


TORCHTITAN = [
    _titan("softmax top-2", "softmax top-k of the token's own scores (dropless)", score_func="softmax"),
    _titan(
        "sigmoid top-2 + expert_bias, route_norm",
        "sigmoid scores + the learned balancing bias for the choice only, top-k per token (dropless)",
        score_func="sigmoid",
        route_norm=True,
        expert_bias=[0.5, -0.5, 0.25, 0.0],
    ),
    _titan(
        "sigmoid top-2, node-limited (2 groups, 1 kept)",
        "top-k inside the token's best expert groups (dropless)",
        score_func="sigmoid",
        num_expert_groups=2,
        num_limited_groups=1,
    ),
    _titan(
        "_debug_force_load_balance",
        "round-robin: expert (n * K + k) mod E for flat token index n = b * T + t",
        score_func="softmax",
        _debug_force_load_balance=True,
    ),
]

FRAMEWORKS: list[FrameworkConfig] = MEGATRON + DEEPSPEED + FAIRSCALE + TORCHTITAN
"""Every framework configuration of the zoo, in table order."""
