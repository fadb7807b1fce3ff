"""Latent experts (LatentMoE): the routed experts compute in a smaller latent width.

Shape legend: N tokens, D model width, L latent width, F expert width, E experts.

The router reads the full hidden state x [N, D]; the routed path runs in the latent space: one
shared down-projection D -> L before dispatch, the experts L -> F -> L, the combine in L, one shared
up-projection L -> D after the combine. Shared experts, norms and the residual stay in D. This is
the layout of NVIDIA's LatentMoE (Nemotron 3, arXiv 2512.20856 §2.2), Megatron-Core's
``moe_latent_size`` (``fc1_latent_proj`` before the dispatch, ``fc2_latent_proj`` after the
combine) and OLMo-core's ``LatentMoEConfig(latent_dim=...)`` (PR #799). Under expert parallelism
the exchange carries L-wide rows: the projections are replicated like the router.
"""

from __future__ import annotations

from torch import nn

from moe.checks import positive_int


class LatentProjections(nn.Module):
    """The bias-free pair ``down`` (D -> L) and ``up`` (L -> D) around a layer's routed experts."""

    def __init__(self, d_model: int, latent_dim: int) -> None:
        super().__init__()
        positive_int("latent_dim", latent_dim)
        if latent_dim >= d_model:
            raise ValueError(
                f"latent_dim={latent_dim} must be smaller than d_model={d_model} (a latent as wide as the model "
                "only adds two projections); leave latent_dim unset for ordinary experts"
            )
        self.d_model, self.latent_dim = d_model, latent_dim
        self.down = nn.Linear(d_model, latent_dim, bias=False)
        self.up = nn.Linear(latent_dim, d_model, bias=False)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, latent_dim={self.latent_dim}"


def latent_ffn_width(experts_per_token: float, d_ff: int, d_model: int, latent_dim: int) -> float:
    """The width of the dense SwiGLU (3 * D * W weights) whose active compute equals that of
    ``experts_per_token`` latent experts (3 * L * F weights each) and the two projections
    (2 * D * L): ``(3 * k * L * F + 2 * D * L) / (3 * D)``."""
    return (3 * experts_per_token * latent_dim * d_ff + 2 * d_model * latent_dim) / (3 * d_model)
