"""Load-balance figures of MoE routing: MaxVio, dead experts, the spread of tokens per expert,
and how many experts each token used.

Shape legend: L MoE layers, E experts, J = E + 1 possible expert counts of a token (0..E).

MaxVio (arXiv 2408.15664, eq. 4) of one layer is ``max_e load_e / mean_e load_e - 1``: 0 for
perfect balance, E - 1 when one expert takes everything. Computed over one training batch it
is MaxVio_batch; over the whole validation set (eval mode), MaxVio_global. A dead expert
received no token. All figures here are read from counts: summing counts over microbatches,
pipeline stages and data-parallel ranks before calling these gives the figure of the whole
step, however it was cut.
"""

from __future__ import annotations

import torch
from torch import Tensor

QUANTILES = {"min": 0.0, "p10": 0.1, "p50": 0.5, "p90": 0.9, "max": 1.0}
"""Name -> quantile of the per-layer tokens-per-expert spread that the metrics report."""


def max_violation(tokens_LE: Tensor) -> Tensor:
    """float64 [L]: MaxVio per layer; 0 for a layer that routed no token."""
    t_LE = tokens_LE.double()
    mean_L = t_LE.mean(-1)
    return torch.where(mean_L > 0, t_LE.max(-1).values / mean_L.clamp_min(1e-300) - 1.0, torch.zeros_like(mean_L))


def balance_summary(tokens_LE: Tensor, prefix: str = "") -> dict:
    """JSON-ready figures of per-layer counts ``tokens_LE``: ``max_vio`` (mean over layers),
    ``max_vio_worst`` (the worst layer), ``dead_experts`` (summed over layers), and per layer
    ``max_vio_layers``, ``dead_experts_layers`` and ``tokens_per_expert_{min,p10,p50,p90,max}``.
    Keys start with ``prefix``."""
    vio_L = max_violation(tokens_LE)
    dead_L = (tokens_LE == 0).sum(-1)
    out = {
        "max_vio": vio_L.mean().item() if vio_L.numel() else 0.0,
        "max_vio_worst": vio_L.max().item() if vio_L.numel() else 0.0,
        "dead_experts": int(dead_L.sum()),
        "max_vio_layers": vio_L.tolist(),
        "dead_experts_layers": dead_L.tolist(),
    }
    if tokens_LE.numel():
        q_QL = torch.quantile(tokens_LE.double(), torch.tensor(list(QUANTILES.values()), dtype=torch.float64), dim=-1)
        out.update({f"tokens_per_expert_{name}": q_QL[i].tolist() for i, name in enumerate(QUANTILES)})
    return {prefix + k: v for k, v in out.items()}


def active_experts_summary(hist_LJ: Tensor, prefix: str = "") -> dict:
    """``active_experts_mean`` (experts per token, mean over tokens and layers),
    ``active_experts_layers`` (per layer) and ``active_experts_hist`` (summed over layers: how
    many token-layer pairs used 0, 1, ..., E experts) of per-layer histograms ``hist_LJ``."""
    h_LJ = hist_LJ.double()
    j_J = torch.arange(h_LJ.shape[-1], dtype=torch.float64)
    per_layer_L = (h_LJ * j_J).sum(-1) / h_LJ.sum(-1).clamp_min(1.0)
    out = {
        "active_experts_mean": ((h_LJ * j_J).sum() / h_LJ.sum().clamp_min(1.0)).item(),
        "active_experts_layers": per_layer_L.tolist(),
        "active_experts_hist": hist_LJ.sum(0).tolist(),
    }
    return {prefix + k: v for k, v in out.items()}
