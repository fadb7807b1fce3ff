"""A swapped transformers causal LM behind this package's model interface, and the models the
training loop builds from ``--hf-model`` (a local directory or a built-in tiny random config;
never a download).

Shape legend: B batch, T sequence, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from moe.generation import generate
from moe.integrations.hf.blocks import HFMoEBlock, swap_moe_blocks, swapped_routings
from moe.lm import ModelOutput, check_token_ids, lm_loss
from moe.routing import DecodeState

TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "mixtral-tiny": ("mixtral", {"num_local_experts": 4, "intermediate_size": 64}),
    "minimax-tiny": ("minimax", {"num_local_experts": 4, "intermediate_size": 64}),
    "granitemoe-tiny": ("granitemoe", {"num_local_experts": 4, "intermediate_size": 64}),
    "olmoe-tiny": ("olmoe", {"num_experts": 4, "intermediate_size": 64}),
    "flexolmo-tiny": ("flex_olmo", {"num_experts": 4, "intermediate_size": 64}),
    "qwen2-moe-tiny": (
        "qwen2_moe",
        {"num_experts": 4, "moe_intermediate_size": 64, "intermediate_size": 64, "shared_expert_intermediate_size": 96},
    ),
    "qwen3-moe-tiny": (
        "qwen3_moe",
        {"num_experts": 4, "moe_intermediate_size": 64, "intermediate_size": 64, "head_dim": 16},
    ),
    "qwen3-next-tiny": (
        "qwen3_next",
        {
            "num_experts": 4,
            "moe_intermediate_size": 64,
            "intermediate_size": 64,
            "shared_expert_intermediate_size": 96,
            "head_dim": 16,
            # Qwen3-Next's pattern, shortened: linear attention, then full attention (the real
            # model has a full-attention layer every 4th). By the default interval both layers
            # of the tiny model were linear, and transformers' cache cannot decode without one.
            "layer_types": ["linear_attention", "full_attention"],
        },
    ),
    "deepseek-v3-tiny": (
        "deepseek_v3",
        {
            "n_routed_experts": 8,
            "n_group": 4,
            "topk_group": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 32,
            "intermediate_size": 64,
            "first_k_dense_replace": 0,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            # Multi-head latent attention: every head reads one latent KV, and DeepSeek-V3's own
            # config says so with num_key_value_heads = num_attention_heads. Left at 2,
            # transformers 5.24 repeats the expanded keys twice and fails on a call of more than
            # one new token through the cache (chunked decoding, the causal evaluation).
            "num_key_value_heads": 4,
        },
    ),
}
"""Name -> (transformers model_type, family-specific fields) of the built-in tiny random configs
(DeepSeek-V3: 8 routed experts in 4 groups, 2 groups per token, one shared expert)."""

TINY_COMMON = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 1024,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
    "tie_word_embeddings": False,
}
"""Fields every tiny config shares: d=64, 2 layers, 4 heads (2 KV), E=4 experts, K=2."""

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""A directory holding one of these is loaded with its weights; one with only config.json is random-initialised."""


def tiny_config(name: str, vocab_size: int, **overrides):
    """The built-in tiny random config ``name`` (see :data:`TINY_CONFIGS`) with ``vocab_size``."""
    from transformers import AutoConfig

    if name not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny config {name!r}; known: {', '.join(sorted(TINY_CONFIGS))}")
    model_type, fields = TINY_CONFIGS[name]
    return AutoConfig.for_model(model_type, **{**TINY_COMMON, **fields, "vocab_size": vocab_size, **overrides})


def load_hf_model(spec: str, vocab_size: int, seed: int = 0, weights: bool = True) -> nn.Module:
    """A transformers causal LM in fp32 from ``spec``: a built-in tiny config name (random
    weights for ``vocab_size`` tokens), or a local directory (with weights: loaded, unless
    ``weights=False``, e.g. for a model built on the meta device; with only ``config.json``:
    random weights). Random weights are drawn from ``seed``. Nothing is downloaded; a model
    with fewer than ``vocab_size`` tokens is refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    path = Path(spec)
    if spec in TINY_CONFIGS:
        model = AutoModelForCausalLM.from_config(tiny_config(spec, vocab_size), dtype=torch.float32)
    elif weights and path.is_dir() and any((path / f).exists() for f in WEIGHT_FILES):
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    elif (path / "config.json").exists():
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(path, local_files_only=True), dtype=torch.float32
        )
    else:
        raise ValueError(
            f"hf model {spec!r} is neither a built-in tiny config ({', '.join(sorted(TINY_CONFIGS))}) "
            "nor a local directory with a config.json"
        )
    if model.config.vocab_size < vocab_size:
        raise ValueError(f"hf model {spec!r} has vocab_size={model.config.vocab_size} < the data's {vocab_size}")
    return model


@dataclass
class HFCache:
    """What :class:`HFCausalLM` decodes with: transformers' own cache of the positions seen so
    far and every swapped block's router decode state (the fields ``moe.lm.check_token_ids``
    reads of ``moe.lm.KVCache``). Made by :meth:`HFCausalLM.init_cache`, updated by each forward."""

    batch_size: int
    """B."""
    max_len: int
    """Positions the cache may hold."""
    router_states: list[DecodeState]
    """Per swapped block, in module order."""
    past: object = None
    """transformers' cache (its ``cache`` argument and output) from the last forward; None before the first."""
    length: int = 0
    """Positions filled."""


class HFCausalLM(nn.Module):
    """``out = HFCausalLM(swapped)(idx_BT, targets_BT)``: a transformers causal LM whose MoE
    blocks were swapped (:func:`swap_moe_blocks`), with ``moe.model.MoETransformer``'s calling
    convention, so this package's training loop, evaluation, audit and agreement figures take
    it as they take ours. ``out.loss`` is the mean next-token cross-entropy against ``targets_BT``
    (already shifted, as the loop gives them), ``out.aux_loss`` the sum of the swapped blocks'
    ``Routing.aux_loss``, ``out.routings`` their routings in block order. Without ``cache`` every
    call is a full forward of the given tokens; with one (``cache = model.init_cache(B)``) a call
    takes the next tokens of the cached sequences, through transformers' KV cache and the
    routers' decode states, as :class:`MoETransformer` decodes.
    """

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        if not any(isinstance(m, HFMoEBlock) for m in hf_model.modules()):
            raise ValueError("HFCausalLM needs a model whose MoE blocks were swapped (swap_moe_blocks)")
        self.hf = hf_model

    def forward(self, idx_BT: Tensor, targets_BT: Tensor | None = None, cache: HFCache | None = None) -> ModelOutput:
        check_token_ids(idx_BT, None, cache)
        blocks = self._swapped()
        for m in blocks:
            m.routing = None
        if cache is None:
            logits_BTV = self.hf(input_ids=idx_BT, use_cache=False).logits
        else:
            before = [m.decode_state for m in blocks]
            try:
                for m, state in zip(blocks, cache.router_states):
                    m.decode_state = state
                out = self.hf(input_ids=idx_BT, cache=cache.past, use_cache=True)
            finally:
                for m, state in zip(blocks, before):
                    m.decode_state = state
            logits_BTV, cache.past = out.logits, out.cache
            cache.length += idx_BT.shape[1]
        routings = swapped_routings(self.hf)
        aux = sum((r.aux_loss for r in routings), logits_BTV.new_zeros((), dtype=torch.float32))
        loss = None if targets_BT is None else lm_loss(logits_BTV, targets_BT)
        return ModelOutput(logits=logits_BTV, aux_loss=aux, routings=routings, loss=loss)

    def _swapped(self) -> list[HFMoEBlock]:
        return [m for m in self.hf.modules() if isinstance(m, HFMoEBlock)]

    def decode_support(self) -> str | None:
        """None if every swapped block's router can decode in the current mode, else why not."""
        for i, m in enumerate(self._swapped()):
            reason = m.moe.router.decode_support()
            if reason is not None:
                return f"MoE block {i}: {reason}"
        return None

    def init_cache(self, batch_size: int, max_len: int | None = None) -> HFCache:
        """An empty cache for ``batch_size`` sequences of at most ``max_len`` positions (default:
        the config's ``max_position_embeddings``); ValueError if a router cannot decode."""
        reason = self.decode_support()
        if reason is not None:
            raise ValueError(reason)
        limit = getattr(self.hf.config, "max_position_embeddings", None)
        max_len = limit if max_len is None else max_len
        if not isinstance(max_len, int) or max_len < 1 or (limit is not None and max_len > limit):
            raise ValueError(f"max_len must be an integer in [1, max_position_embeddings={limit}], got {max_len!r}")
        states = [m.moe.router.init_decode_state(batch_size) for m in self._swapped()]
        return HFCache(batch_size, max_len, states)

    @property
    def blocks(self) -> nn.ModuleList:
        """The decoder layers (what FSDP2 shards as units, and activation checkpointing and
        ``torch.compile`` take one at a time, as the preset model's blocks)."""
        return self.hf.get_decoder().layers

    @property
    def max_seq_len(self) -> int:
        """The positions the model reads (its config's ``max_position_embeddings``)."""
        return self.hf.config.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.hf.config.vocab_size

    def generate(self, idx: Tensor | list[Tensor], max_new_tokens: int, **options) -> Tensor | list[Tensor] | tuple:
        """Sample as ``MoETransformer.generate`` does (:func:`moe.generation.generate`: the same
        options, the same seeded draws), through transformers' KV cache and the routers' decode
        states, in a context of :attr:`max_seq_len` positions."""
        return generate(self, idx, max_new_tokens, context=self.max_seq_len, **options)

    def num_parameters(self) -> int:
        """All parameters (shared ones once)."""
        return sum(p.numel() for p in self.parameters())

    @property
    def architecture(self) -> str:
        """The wrapped model's transformers class (``OlmoeForCausalLM``), named by its config's
        model type (the class itself is renamed once FSDP2 shards it)."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        model_type = self.hf.config.model_type
        return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, model_type)


def hf_model_from_config(config: dict, router: str, router_options: dict, backend: str = "torch") -> HFCausalLM:
    """A swapped model as a run built it, from its transformers config (``config.to_dict()``),
    with random fp32 weights (what ``--export-model`` files hold is loaded into it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    return HFCausalLM(swap_moe_blocks(model, router, backend=backend, **router_options))


def build_hf_model(
    spec: str,
    router: str,
    router_options: dict,
    vocab_size: int,
    seed: int = 0,
    backend: str = "torch",
    expert_parallel=None,
    weights: bool = True,
) -> HFCausalLM:
    """What ``experiments/train.py --hf-model SPEC --router R`` trains: :func:`load_hf_model`,
    every MoE block swapped to ``router`` (``topk`` with no options keeps the family's routing;
    ``expert_parallel``: a ``moe.parallel.ExpertParallel``, each block then keeps only this
    rank's experts; ``weights=False``: a directory's weights are not read), wrapped in
    :class:`HFCausalLM`."""
    model = load_hf_model(spec, vocab_size, seed, weights)
    swapped = swap_moe_blocks(model, router, backend=backend, expert_parallel=expert_parallel, **router_options)
    return HFCausalLM(swapped)
