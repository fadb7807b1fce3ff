"""A ``MoETransformer`` as transformers' Mixtral, where Mixtral computes what it computes.

Shape legend: D model width, H heads, Dh head width, E experts, F expert width.

Both are pre-norm decoders with RMSNorm, rotary positions, causal softmax attention scaled by
1/sqrt(Dh), SwiGLU experts and no bias terms; Mixtral's router takes the softmax over the E
experts, its top K and renormalises them (``TopKRouter`` with a softmax gate and ``normalize``).
What differs is only where the numbers live:

* our ``qkv`` [3D, D] is Mixtral's ``q_proj``, ``k_proj``, ``v_proj`` [D, D] stacked (H = KV heads);
* our rotary turns the pairs of dims (2i, 2i+1) of each head, Mixtral's (i, i + Dh/2)
  (``rotate_half``), at the same frequency theta^(-2i/Dh): q's and k's rows are reordered
  within each head (evens, then odds), which leaves every q . k unchanged;
* our experts ``w_gate``, ``w_up`` [E, D, F] and ``w_down`` [E, F, D] are Mixtral's
  ``gate_up_proj`` [E, 2F, D] (gate rows first) and ``down_proj`` [E, D, F], transposed.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import MixtralConfig, MixtralForCausalLM

from moe.layer import MoELayer
from moe.model import MoETransformer
from moe.routers import TopKRouter
from moe.routing import Router

EXACT_ROUTER_DTYPES = ("fp32", "input")
"""The router dtypes that compute as Mixtral's gate does in an fp32 model."""


def router_mismatch(router: Router) -> str | None:
    """Why ``router`` does not route as Mixtral's gate routes (None: it does)."""
    if type(router) is not TopKRouter:
        return f"router {router.name!r} has no Mixtral counterpart (Mixtral routes with top-k token choice)"
    checks = [
        (router.gate_fn == "softmax", f"gate={router.gate_fn!r} (Mixtral: softmax)"),
        (router.normalize or not router.pre_softmax, "normalize=False (Mixtral renormalises the top-k weights)"),
        (router.route_scale == 1.0, f"route_scale={router.route_scale}"),
        (router.num_expert_groups is None, "group-limited routing (num_expert_groups)"),
        (not router.null_experts, f"null_experts={router.null_experts}"),
        (not bool(router.balance_bias.any()), "a non-zero balance bias (aux-loss-free balancing)"),
        (router.router_dtype in EXACT_ROUTER_DTYPES, f"router_dtype={router.router_dtype!r}"),
    ]
    return next((f"topk with {what}" for ok, what in checks if not ok), None)


def mixtral_mismatch(model: MoETransformer) -> str | None:
    """Why ``model`` is not a Mixtral (None: it is one, to rounding)."""
    cfg = model.cfg
    if not all(cfg.is_moe_block(i) for i in range(cfg.n_layers)):
        return f"dense blocks (moe_every={cfg.moe_every}; every Mixtral block is an MoE block)"
    if cfg.shared_experts:
        return "shared experts (Mixtral has none)"
    for i, layer in enumerate(m for m in model.modules() if isinstance(m, MoELayer)):
        reason = router_mismatch(layer.router)
        if reason is not None:
            return f"MoE block {i}: {reason}"
    return None


def mixtral_config(model: MoETransformer) -> MixtralConfig:
    cfg = model.cfg
    router = model.routers()[0]
    return MixtralConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.moe_d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        head_dim=cfg.d_model // cfg.n_heads,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=router.top_k,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        sliding_window=None,
        router_jitter_noise=0.0,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        dtype="float32",
    )


def mixtral_state_dict(model: MoETransformer) -> dict[str, Tensor]:
    """``model``'s weights under Mixtral's names and layouts (see the module docstring)."""
    cfg = model.cfg
    d, h = cfg.d_model, cfg.n_heads
    # per head: rows 0, 2, 4, ..., then 1, 3, 5, ... (our pair (2i, 2i+1) becomes Mixtral's (i, i + Dh/2))
    rope_rows_D = torch.arange(d).view(h, d // h // 2, 2).transpose(1, 2).reshape(d)
    state = {
        "model.embed_tokens.weight": model.embed.weight,
        "model.norm.weight": model.norm.weight,
        "lm_head.weight": model.head.weight,
    }
    for i, block in enumerate(model.blocks):
        q_DD, k_DD, v_DD = block.attn.qkv.weight.chunk(3, dim=0)
        experts = block.ffn.experts
        layer = {
            "input_layernorm.weight": block.attn_norm.weight,
            "post_attention_layernorm.weight": block.ffn_norm.weight,
            "self_attn.q_proj.weight": q_DD[rope_rows_D],
            "self_attn.k_proj.weight": k_DD[rope_rows_D],
            "self_attn.v_proj.weight": v_DD,
            "self_attn.o_proj.weight": block.attn.proj.weight,
            "mlp.gate.weight": block.ffn.router.gate.weight,
            "mlp.experts.gate_up_proj": torch.cat([experts.w_gate.transpose(1, 2), experts.w_up.transpose(1, 2)], 1),
            "mlp.experts.down_proj": experts.w_down.transpose(1, 2),
        }
        state.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return {k: v.detach().contiguous() for k, v in state.items()}


def to_mixtral(model: MoETransformer) -> MixtralForCausalLM:
    """A Mixtral computing what ``model`` computes (call :func:`mixtral_mismatch` first)."""
    mixtral = MixtralForCausalLM(mixtral_config(model))
    mixtral.load_state_dict(mixtral_state_dict(model), strict=True)
    return mixtral.eval()
