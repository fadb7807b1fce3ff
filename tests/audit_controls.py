"""Positive and negative controls for the causality audit, shared by the audit tests.

Each builder takes a seed and returns (target, example input). Shapes are small: B=4, T=16, D=8.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moe.model import MoETransformer, preset
from moe.routing import build_router

B, T, D = 4, 16, 8
LEAK_FROM, LEAK_TO = 11, 5
"""The single-position control: output position LEAK_TO reads input position LEAK_FROM."""


def example(seed: int, d: int = D) -> Tensor:
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed))


class PositionwiseMLP(nn.Module):
    """A dense MLP applied to each position on its own: causal and batch-invariant."""

    def __init__(self, d: int = D, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class SequenceMeanLeak(PositionwiseMLP):
    """Adds coef * (mean over the whole sequence): a continuous future leak."""

    def __init__(self, coef: float, seed: int = 0, train_only: bool = False) -> None:
        super().__init__(seed=seed)
        self.coef, self.train_only = coef, train_only

    def forward(self, x: Tensor) -> Tensor:
        y = self.net(x)
        if self.training or not self.train_only:
            y = y + self.coef * x.mean(dim=1, keepdim=True)
        return y


class SinglePositionLeak(PositionwiseMLP):
    """Output position LEAK_TO also reads input position LEAK_FROM; everything else is causal."""

    def forward(self, x: Tensor) -> Tensor:
        y = self.net(x)
        if x.shape[1] <= LEAK_FROM:  # a prefix without the leaking position
            return y
        leak = torch.zeros_like(y)
        leak[:, LEAK_TO] = 0.5 * x[:, LEAK_FROM]
        return y + leak


class PrefixMean(nn.Module):
    """Cumulative mean over positions 0..t: a sequence statistic that is causal."""

    def forward(self, x: Tensor) -> Tensor:
        count = torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        return x.cumsum(dim=1) / count


class BatchMixer(PositionwiseMLP):
    """Mixes the samples of the batch at the same position: clean in time, not batch-invariant."""

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x) + 0.5 * x.mean(dim=0, keepdim=True)


def router(name: str, seed: int, d: int = 32, **options) -> nn.Module:
    torch.manual_seed(seed)
    return build_router(name, d_model=d, num_experts=4, **options)


def token_model(router_name: str, seed: int) -> tuple[nn.Module, Tensor]:
    torch.manual_seed(seed)
    model = MoETransformer(preset("tiny", router=router_name))
    idx = torch.randint(0, model.cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))
    return model, idx


POSITIVE = {
    "expert_choice": lambda s: (router("expert_choice", s), example(s, 32)),
    "capacity_score": lambda s: (router("capacity", s, priority="score"), example(s, 32)),
    "gshard_top2_choice": lambda s: (router("capacity", s, top_k=2, priority="choice"), example(s, 32)),
    "sequence_mean_1e-4": lambda s: (SequenceMeanLeak(1e-4, seed=s), example(s)),
    "single_position": lambda s: (SinglePositionLeak(seed=s), example(s)),
    "token_model_expert_choice": lambda s: token_model("expert_choice", s),
}
"""Targets that leak in both modes (default router options: capacity factor 1.25 for capacity)."""

NEGATIVE = {
    "dense_mlp": lambda s: (PositionwiseMLP(seed=s), example(s)),
    "dropless_topk": lambda s: (router("topk", s, top_k=2), example(s, 32)),
    "capacity_position_sequence": lambda s: (router("capacity", s, priority="position", capacity_factor=1.0), example(s, 32)),
    "prefix_mean": lambda s: (PrefixMean(), example(s)),
    "batch_mixer": lambda s: (BatchMixer(seed=s), example(s)),
}
"""Targets that never leak into the past."""
