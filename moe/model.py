"""A small decoder-only language model with MoE blocks, in the style of current LLMs.

RMSNorm (pre-norm), rotary positions, causal attention through
``scaled_dot_product_attention``, SwiGLU feed-forwards, no bias terms anywhere. Any router,
by name, in place of some or all feed-forwards.

Decoding: ``model(idx, cache=cache)`` processes only new tokens given a :class:`KVCache`
(``model.init_cache(B)``), and :meth:`MoETransformer.generate` samples with it. The cache holds
every block's keys and values and every MoE router's decode state; routers that are not
decode-consistent cannot be cached and are decoded by recomputing the prefix instead.

Shape legend: B batch, T sequence (new tokens), S cache length, D model width, H heads,
Dh head width, V vocabulary.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moe.checks import nonnegative_int, positive_int
from moe.generation import generate
from moe.layer import MoELayer
from moe.lm import KVCache, ModelOutput, check_token_ids, empty_cache, lm_loss
from moe.routers.hash import block_router
from moe.routing import Claims, DecodeState, Router, Routing, held_claims
from moe.shared import SwiGLU


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
    """Hidden width of the dense SwiGLU feed-forward of the blocks *without* MoE (see moe_every);
    unused when every block is an MoE block (moe_every=1, the default), whose width is moe_d_ff."""
    moe_d_ff: int = 128
    """F: hidden width of each expert: the feed-forward width of the MoE blocks."""
    num_experts: int = 4
    """E: experts per MoE block."""
    shared_experts: int = 0
    """S: experts of width moe_d_ff that every token of an MoE block uses beside its routed
    ones (DeepSeek-V2/V3, Qwen2/3-MoE), one SwiGLU of width S * moe_d_ff; 0 = none."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output by sigmoid(x . w) per token (Qwen2-MoE's shared_expert_gate)."""
    moe_latent_dim: int | None = None
    """L < d_model: latent experts (``moe.latent``; Megatron-Core's moe_latent_size, OLMo-core's
    LatentMoEConfig.latent_dim): the router reads the full hidden state, the routed experts a
    D -> L projection of it, their combined output projected back L -> D; None = off."""
    router: str = "topk"
    """Router name (``moe.list_routers()``)."""
    router_options: dict = field(default_factory=dict)
    """Options for the router, e.g. ``{"top_k": 2}`` or ``{"capacity_factor": 1.0}``
    (``preset`` says which of a preset's options carry over to another router)."""
    moe_every: int = 1
    """Block i uses MoE iff (i + 1) % moe_every == 0; 1 = every block, 0 = dense model."""
    hash_layers: int = 0
    """Blocks 0 .. hash_layers-1 (MoE blocks all) route by a fixed table of token ids (router
    ``hash``, with the options of ``router_options`` that set the weights; DeepSeek-V4, MaxText's
    first_num_hash_layers, torchtitan's n_hash_layers); 0 = none."""
    max_seq_len: int = 256
    """Longest sequence the rotary tables cover."""
    rope_theta: float = 10000.0
    """Rotary base."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_embeddings: bool = True
    """Share the input embedding and the output projection."""
    backend: str = "torch"
    """MoE data path: "torch", "triton", "grouped_mm" or "auto" (``moe.experts.BACKENDS``)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "moe_d_ff", "num_experts", "max_seq_len"):
            positive_int(f"ModelConfig.{name}", getattr(self, name))
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide d_model={self.d_model}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"head width d_model/n_heads={self.d_model // self.n_heads} must be even for rotary positions"
            )
        nonnegative_int("ModelConfig.shared_experts", self.shared_experts)
        if self.shared_expert_gate and not self.shared_experts:
            raise ValueError("shared_expert_gate needs shared_experts > 0")
        if self.moe_latent_dim is not None and not (
            isinstance(self.moe_latent_dim, int) and 0 < self.moe_latent_dim < self.d_model
        ):
            raise ValueError(
                f"moe_latent_dim must be an integer in [1, d_model={self.d_model}), got {self.moe_latent_dim!r}"
            )
        if not isinstance(self.moe_every, int) or self.moe_every < 0:
            raise ValueError(f"moe_every must be an integer >= 0, got {self.moe_every!r}")
        nonnegative_int("ModelConfig.hash_layers", self.hash_layers)
        if not all(self.is_moe_block(i) for i in range(min(self.hash_layers, self.n_layers))):
            raise ValueError(f"hash_layers={self.hash_layers} names dense blocks (moe_every={self.moe_every})")
        if self.hash_layers > self.n_layers:
            raise ValueError(f"hash_layers={self.hash_layers} exceeds n_layers={self.n_layers}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError("rope_theta and norm_eps must be > 0")

    def is_moe_block(self, i: int) -> bool:
        return self.moe_every > 0 and (i + 1) % self.moe_every == 0

    def uses_d_ff(self) -> bool:
        """Whether some block is dense, i.e. whether ``d_ff`` matters."""
        return not all(self.is_moe_block(i) for i in range(self.n_layers))


PRESETS: dict[str, ModelConfig] = {
    # Trains a few hundred steps on 2 CPU cores in about a minute.
    "tiny": ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=128, moe_d_ff=128, num_experts=4, max_seq_len=128),
    # A CPU-sized model for real (short) studies.
    "small": ModelConfig(d_model=256, n_layers=4, n_heads=8, d_ff=512, moe_d_ff=512, num_experts=8, max_seq_len=512),
    # About 100M parameters (about 36M active with top-2): a GPU preset.
    "gpu100m": ModelConfig(
        d_model=768,
        n_layers=6,
        n_heads=12,
        d_ff=2048,
        moe_d_ff=768,
        num_experts=8,
        max_seq_len=1024,
        router_options={"top_k": 2},
    ),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named preset with fields overridden: ``preset("tiny", router="expert_choice")``.

    Router options follow one rule (the trainer builds its model through this function too):
    the preset's ``router_options`` belong to the preset's router, so they carry over only when
    the router is unchanged; another router starts from its own defaults. ``router_options``
    given here are merged on top of what carries over (``preset("gpu100m",
    router_options={"gate": "sigmoid"})`` keeps the preset's ``top_k``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    known = {f.name for f in fields(ModelConfig)}
    bad = set(overrides) - known
    if bad:
        raise ValueError(f"unknown ModelConfig fields {sorted(bad)}")
    base = PRESETS[name]
    carried = dict(base.router_options) if overrides.get("router", base.router) == base.router else {}
    overrides["router_options"] = {**carried, **overrides.get("router_options", {})}
    return replace(base, **overrides)


class Rotary(nn.Module):
    """Rotary position embedding tables; positions start..start+T-1 of the input."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles_TH = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles_TH.cos().float(), persistent=False)
        self.register_buffer("sin", angles_TH.sin().float(), persistent=False)

    def forward(self, x_BHTd: Tensor, start: int = 0) -> Tensor:
        t = x_BHTd.shape[-2]
        cos, sin = self.cos[start : start + t].to(x_BHTd.dtype), self.sin[start : start + t].to(x_BHTd.dtype)
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

    def forward(self, x_BTD: Tensor, cache: KVCache | None = None, layer: int = 0) -> Tensor:
        """Causal self-attention over x; with ``cache``, x holds positions cache.length.. and
        attends to the cached keys and values of block ``layer`` too (which it extends)."""
        b, t, d = x_BTD.shape
        start = 0 if cache is None else cache.length
        q, k, v = self.qkv(x_BTD).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k = self.rotary(q, start), self.rotary(k, start)
        if cache is None:
            y_BHTd = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            if cache.keys[layer] is None:
                cache.keys[layer] = k.new_zeros(b, self.n_heads, cache.max_len, d // self.n_heads)
                cache.values[layer] = torch.zeros_like(cache.keys[layer])
            cache.keys[layer][:, :, start : start + t] = k
            cache.values[layer][:, :, start : start + t] = v
            k_BHSd, v_BHSd = cache.keys[layer][:, :, : start + t], cache.values[layer][:, :, : start + t]
            # query i (position start+i) sees keys 0..start+i
            pos_S = torch.arange(start + t, device=x_BTD.device)
            mask_TS = pos_S <= pos_S[start:, None]
            y_BHTd = F.scaled_dot_product_attention(q, k_BHSd, v_BHSd, attn_mask=mask_TS)
        return self.proj(y_BHTd.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, use_moe: bool, expert_parallel=None, index: int = 0) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        if use_moe:
            router, options = block_router(
                cfg.router, cfg.router_options, cfg.vocab_size, index, index < cfg.hash_layers
            )
            self.ffn = MoELayer(
                cfg.d_model,
                cfg.moe_d_ff,
                cfg.num_experts,
                router=router,
                backend=cfg.backend,
                expert_parallel=expert_parallel,
                shared_experts=cfg.shared_experts,
                shared_expert_gate=cfg.shared_expert_gate,
                latent_dim=cfg.moe_latent_dim,
                **options,
            )
        else:
            self.ffn = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(
        self, x_BTD: Tensor, cache: KVCache | None = None, layer: int = 0, token_ids_BT: Tensor | None = None
    ) -> tuple[Tensor, Routing | None]:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), cache, layer)
        h = self.ffn_norm(x_BTD)
        if isinstance(self.ffn, MoELayer):
            state = None if cache is None else cache.router_states[layer]
            y, routing = self.ffn(h, return_routing=True, decode_state=state, token_ids_BT=token_ids_BT)
            return x_BTD + y, routing
        return x_BTD + self.ffn(h), None

    def init_decode_state(self, batch_size: int) -> DecodeState | None:
        """The router's empty decode state for ``batch_size`` sequences (None for a dense block)."""
        return self.ffn.router.init_decode_state(batch_size) if isinstance(self.ffn, MoELayer) else None


class MoETransformer(nn.Module):
    """Decoder-only LM: ``out = model(idx_BT, targets_BT)``; ``out.loss + out.aux_loss`` to train.

    Decoding: ``cache = model.init_cache(B)``, then ``model(new_BT, cache=cache)`` for each chunk
    of new tokens (a prompt, then one token at a time); ``model.generate(idx, n)`` samples.

    ``expert_parallel`` (a ``moe.parallel.ExpertParallel``) shards every MoE block's experts
    over its process group; initialise such a model from a single-process one with
    ``moe.parallel.load_full_state_dict``.
    """

    def __init__(self, cfg: ModelConfig, expert_parallel=None, init_seed: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        # drawn before any submodule draws, so the global generator's state alone decides it
        self.init_seed = int(torch.randint(2**62, (), device="cpu")) if init_seed is None else init_seed
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, cfg.is_moe_block(i), expert_parallel, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Give every parameter its initial values from :meth:`init_parameter` (parameters on
        the meta device are left to ``moe.parallel.materialize``, which uses the same rule)."""
        for name, p in self.named_parameters():
            if not p.is_meta:
                full = torch.empty(p.shape, dtype=p.dtype)
                self.init_parameter(name, full)
                p.copy_(full)

    @torch.no_grad()
    def init_parameter(self, name: str, full: Tensor) -> None:
        """Fill ``full``, parameter ``name`` at its single-process shape (all experts), with its
        initial values, drawn from a CPU generator seeded by ``init_seed`` and the name alone:
        the same numbers whichever rank, layout or device asks, one parameter at a time.

        Norm gains are 1, the embedding is N(0, 0.02), every other weight (attention, dense
        and expert feed-forwards, router gates, the untied head) is N(0, 1/fan_in) with fan_in
        = shape[1] ([out, in] linear weights, [E, in, out] expert weights), and the projections
        back into the residual stream are scaled by 1/sqrt(2 * n_layers)."""
        if full.dim() == 1:
            full.fill_(1.0)
            return
        # the CPU generator keeps 32 bits of its seed: hash the seed and the name into 32 bits
        gen = torch.Generator().manual_seed(zlib.crc32(f"{self.init_seed}/{name}".encode()))
        std = 0.02 if name == "embed.weight" else full.shape[1] ** -0.5
        if name.endswith(("proj.weight", "w_down.weight", "experts.w_down")):
            std /= math.sqrt(2 * self.cfg.n_layers)
        full.normal_(0.0, std, generator=gen)

    def forward(self, idx_BT: Tensor, targets_BT: Tensor | None = None, cache: KVCache | None = None) -> ModelOutput:
        """Logits of every position of ``idx_BT``. With ``cache``, ``idx_BT`` holds the next T
        tokens of the cached sequences (absolute positions cache.length..): they attend to the
        cached positions, are routed from the routers' decode states, and the cache advances by T.
        The result equals the corresponding rows of a full-sequence forward."""
        routings: list[Routing] = []

        def keep(x_BTD: Tensor, layer: int, routing: Routing) -> Tensor:
            routings.append(routing)
            return x_BTD

        x_BTD = self.forward_blocks(self.embed_tokens(idx_BT, cache), cache, keep, idx_BT)
        if cache is not None:
            cache.length += idx_BT.shape[1]
        logits_BTV = self.output_logits(x_BTD)
        aux = sum((r.aux_loss for r in routings), logits_BTV.new_zeros((), dtype=torch.float32))
        loss = None if targets_BT is None else lm_loss(logits_BTV, targets_BT)
        return ModelOutput(logits=logits_BTV, aux_loss=aux, routings=routings, loss=loss)

    # The three pieces of the forward. They read only ``cfg``, ``embed``, ``blocks`` (a ModuleList,
    # or a ModuleDict keyed by block index), ``norm`` and ``head``, so a pipeline stage holding
    # some of those modules calls them on itself (``MoETransformer.forward_blocks(stage, ...)``).

    def embed_tokens(self, idx_BT: Tensor, cache: KVCache | None = None) -> Tensor:
        """Validated token ids [B, T] -> embeddings [B, T, D]."""
        check_token_ids(idx_BT, self.cfg.max_seq_len, cache)
        if idx_BT.numel() and not torch.compiler.is_compiling():  # a raw IndexError otherwise (a device assert on CUDA)
            low, high = int(idx_BT.min()), int(idx_BT.max())
            if low < 0 or high >= self.cfg.vocab_size:
                raise ValueError(
                    f"token ids in [{low}, {high}] are outside the vocabulary [0, {self.cfg.vocab_size}): "
                    "tokenize with the model's tokenizer, or build it with a larger vocab_size"
                )
        return self.embed(idx_BT)

    def forward_blocks(
        self, x_BTD: Tensor, cache: KVCache | None = None, on_routing=None, token_ids_BT: Tensor | None = None
    ) -> Tensor:
        """Run the held blocks in order; after each MoE block, ``x = on_routing(x, layer, routing)``
        (block index ``layer``) lets the caller keep the routing (and rewire x). ``token_ids_BT``:
        the input's token ids, for the blocks that route by them (``hash_layers``)."""
        blocks = self.blocks.items() if isinstance(self.blocks, nn.ModuleDict) else enumerate(self.blocks)
        for name, block in blocks:
            x_BTD, routing = block(x_BTD, cache, int(name), token_ids_BT)
            if routing is not None and on_routing is not None:
                x_BTD = on_routing(x_BTD, int(name), routing)
        return x_BTD

    def output_logits(self, x_BTD: Tensor) -> Tensor:
        """Final norm and output projection: [B, T, D] -> logits [B, T, V]."""
        return self.head(self.norm(x_BTD))

    @property
    def claims(self) -> Claims:
        """What the model promises (``moe.audit`` checks it, as any module's ``claims``): each
        claim where every router of its blocks makes it; a model of dense blocks makes them all
        (:func:`~moe.routing.held_claims`)."""
        return held_claims(self)

    def routers(self) -> list[Router]:
        """The router of every MoE block, in block order."""
        return [m.router for m in self.modules() if isinstance(m, MoELayer)]

    @property
    def max_seq_len(self) -> int:
        """The positions the model reads (``cfg.max_seq_len``), as ``HFCausalLM.max_seq_len``."""
        return self.cfg.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def decode_support(self) -> str | None:
        """None if every router can decode from a KV cache in the current mode, else why not."""
        for i, router in enumerate(self.routers()):
            reason = router.decode_support()
            if reason is not None:
                return f"MoE block {i}: {reason}"
        return None

    def init_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty cache for ``batch_size`` sequences of at most ``max_len`` (default
        ``max_seq_len``) positions; ValueError if a router cannot decode in the current mode."""
        return empty_cache(
            self.cfg.n_layers,
            self.cfg.max_seq_len,
            dict(enumerate(self.blocks)),
            batch_size,
            max_len,
            self.decode_support,
        )

    def generate(self, idx: Tensor | list[Tensor], max_new_tokens: int, **options) -> Tensor | list[Tensor] | tuple:
        """Sample ``max_new_tokens`` tokens after each prompt, in eval mode, with a KV cache, in a
        context of ``max_seq_len`` tokens: :func:`moe.generation.generate`, whose options
        (``temperature``, ``top_k``, ``seed``, ``recompute``, ``return_logits``) it takes."""
        return generate(self, idx, max_new_tokens, context=self.cfg.max_seq_len, **options)

    def num_parameters(self, active: bool = False) -> int:
        """All parameters, or those one token uses on average when ``active``: of each MoE
        layer's E experts, the number its router's options set per token
        (``Router.nominal_experts_per_token``: top-k, the capacity factor of expert choice, a
        target; 1 where the options set none), and all of its shared experts and router (and
        its latent projections: latent experts count at their width L). A float in general,
        rounded to an int."""
        total = sum(p.numel() for p in self.parameters())
        if not active:
            return total
        for m in self.modules():
            if isinstance(m, MoELayer):
                per_expert = sum(p[0].numel() for p in m.experts.parameters())
                total -= per_expert * (m.num_experts - (m.router.nominal_experts_per_token() or 1))
        return round(total)
