"""A small decoder-only language model with MoE blocks, in the style of current LLMs.

RMSNorm (pre-norm), rotary positions, causal attention through
``scaled_dot_product_attention``, SwiGLU feed-forwards, no bias terms anywhere. Any router,
by name, in place of some or all feed-forwards.

Shape legend: B batch, T sequence, D model width, H heads, Dh head width, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.layer import MoELayer
from moe.routing import Routing


@dataclass
class ModelConfig:
    """Configuration of :class:`MoETransformer`; validated on construction."""

    vocab_size: int = 256
    """V: vocabulary size (256 for bytes)."""
    d_model: int = 64
    """D: residual width."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """H: attention heads; must divide d_model."""
    d_ff: int = 128
    """Hidden width of the dense SwiGLU in blocks without MoE."""
    moe_d_ff: int = 128
    """F: hidden width of each expert."""
    num_experts: int = 4
    """E: experts per MoE block."""
    router: str = "topk"
    """Router name (``moe.list_routers()``)."""
    router_options: dict = field(default_factory=dict)
    """Options for the router, e.g. ``{"top_k": 2}`` or ``{"capacity_factor": 1.0}``."""
    moe_every: int = 1
    """Block i uses MoE iff (i + 1) % moe_every == 0; 1 = every block, 0 = dense model."""
    max_seq_len: int = 256
    """Longest sequence the rotary tables cover."""
    rope_theta: float = 10000.0
    """Rotary base."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_embeddings: bool = True
    """Share the input embedding and the output projection."""
    backend: str = "torch"
    """MoE data path: "torch", "triton" or "auto"."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "moe_d_ff", "num_experts", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {v!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide d_model={self.d_model}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head width d_model/n_heads={self.d_model // self.n_heads} must be even for rotary positions")
        if not isinstance(self.moe_every, int) or self.moe_every < 0:
            raise ValueError(f"moe_every must be an integer >= 0, got {self.moe_every!r}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError("rope_theta and norm_eps must be > 0")

    def is_moe_block(self, i: int) -> bool:
        return self.moe_every > 0 and (i + 1) % self.moe_every == 0


PRESETS: dict[str, ModelConfig] = {
    # Trains a few hundred steps on 2 CPU cores in about a minute.
    "tiny": ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=128, moe_d_ff=128, num_experts=4, max_seq_len=128),
    # A CPU-sized model for real (short) studies.
    "small": ModelConfig(d_model=256, n_layers=4, n_heads=8, d_ff=512, moe_d_ff=512, num_experts=8, max_seq_len=512),
    # About 100M parameters (about 36M active with top-2): a GPU preset.
    "gpu100m": ModelConfig(
        d_model=768, n_layers=6, n_heads=12, d_ff=2048, moe_d_ff=768, num_experts=8,
        max_seq_len=1024, router_options={"top_k": 2},
    ),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named preset with fields overridden: ``preset("tiny", router="expert_choice")``."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    known = {f.name for f in fields(ModelConfig)}
    bad = set(overrides) - known
    if bad:
        raise ValueError(f"unknown ModelConfig fields {sorted(bad)}")
    return replace(PRESETS[name], **overrides)


@dataclass
class ModelOutput:
    logits: Tensor
    """[B, T, V]."""
    aux_loss: Tensor
    """Scalar: the sum of every MoE block's ``Routing.aux_loss``."""
    routings: list[Routing]
    """One Routing per MoE block, in block order."""
    loss: Tensor | None = None
    """Mean next-token cross-entropy when targets were given (aux loss not included)."""


class Rotary(nn.Module):
    """Rotary position embedding tables; positions 0..T-1 of the input."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles_TH = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles_TH.cos().float(), persistent=False)
        self.register_buffer("sin", angles_TH.sin().float(), persistent=False)

    def forward(self, x_BHTd: Tensor) -> Tensor:
        t = x_BHTd.shape[-2]
        cos, sin = self.cos[:t].to(x_BHTd.dtype), self.sin[:t].to(x_BHTd.dtype)
        x1, x2 = x_BHTd[..., 0::2], x_BHTd[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return out.flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.rotary = Rotary(cfg.d_model // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)

    def forward(self, x_BTD: Tensor) -> Tensor:
        b, t, d = x_BTD.shape
        q, k, v = self.qkv(x_BTD).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k = self.rotary(q), self.rotary(k)
        y_BHTd = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y_BHTd.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    """Dense bias-free SwiGLU feed-forward."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=False)
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, use_moe: bool, expert_parallel=None) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        if use_moe:
            self.ffn = MoELayer(
                cfg.d_model, cfg.moe_d_ff, cfg.num_experts, router=cfg.router, backend=cfg.backend,
                expert_parallel=expert_parallel, **cfg.router_options,
            )
        else:
            self.ffn = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x_BTD: Tensor) -> tuple[Tensor, Routing | None]:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD))
        h = self.ffn_norm(x_BTD)
        if isinstance(self.ffn, MoELayer):
            y, routing = self.ffn(h, return_routing=True)
            return x_BTD + y, routing
        return x_BTD + self.ffn(h), None


class MoETransformer(nn.Module):
    """Decoder-only LM: ``out = model(idx_BT, targets_BT)``; ``out.loss + out.aux_loss`` to train.

    ``expert_parallel`` (a ``moe.parallel.ExpertParallel``) shards every MoE block's experts
    over its process group; initialise such a model from a single-process one with
    ``moe.parallel.load_full_state_dict``.
    """

    def __init__(self, cfg: ModelConfig, expert_parallel=None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, cfg.is_moe_block(i), expert_parallel) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def _init_weights(self) -> None:
        nn.init.normal_(self.embed.weight, std=0.02)
        for name, p in self.named_parameters():
            if p.dim() == 2 and "embed" not in name and not name.endswith("router.gate.weight"):
                nn.init.normal_(p, std=1 / math.sqrt(p.shape[1]))
            if name.endswith(("proj.weight", "w_down.weight", "experts.w_down")):
                with torch.no_grad():
                    p.mul_(1 / math.sqrt(2 * self.cfg.n_layers))

    def forward(self, idx_BT: Tensor, targets_BT: Tensor | None = None) -> ModelOutput:
        if idx_BT.dim() != 2 or idx_BT.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"expected int64 token ids of shape [B, T], got {idx_BT.dtype} {tuple(idx_BT.shape)}")
        if idx_BT.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {idx_BT.shape[1]} exceeds max_seq_len={self.cfg.max_seq_len}")
        x_BTD = self.embed(idx_BT)
        routings: list[Routing] = []
        for block in self.blocks:
            x_BTD, routing = block(x_BTD)
            if routing is not None:
                routings.append(routing)
        logits_BTV = self.head(self.norm(x_BTD))
        aux = sum((r.aux_loss for r in routings), logits_BTV.new_zeros((), dtype=torch.float32))
        loss = None
        if targets_BT is not None:
            loss = F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten())
        return ModelOutput(logits=logits_BTV, aux_loss=aux, routings=routings, loss=loss)

    def num_parameters(self, active: bool = False) -> int:
        """All parameters, or those one token uses (experts counted as top_k of E when active)."""
        total = sum(p.numel() for p in self.parameters())
        if not active:
            return total
        k = self.cfg.router_options.get("top_k", 2 if self.cfg.router in ("topk", "capacity") else 1)
        for m in self.modules():
            if isinstance(m, MoELayer):
                per_expert = sum(p[0].numel() for p in m.experts.parameters())
                total -= per_expert * (m.num_experts - k)
        return total
