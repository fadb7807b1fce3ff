"""transformers classes for the models that no transformers architecture computes: this
package's ``MoETransformer`` with a router (or a feature) that Mixtral lacks, and a transformers
model whose MoE blocks route with one of our routers. :func:`moe.integrations.hf.export_pretrained`
writes their checkpoint folders; ``AutoModelForCausalLM.from_pretrained`` loads them once this
module is imported (it registers both classes with ``AutoConfig`` and ``AutoModelForCausalLM``),
or with ``trust_remote_code=True``, through the folder's ``auto_map`` and the two-line module
:data:`REMOTE_CODE` beside its config, which imports these classes from the installed package.

Generating: each step forwards the whole sequence so far (transformers' cache, when it makes one,
is not read), so every router, expert choice included, routes as the full forward does: what
``MoETransformer.generate(..., recompute=True)`` computes. Prompts of equal length, no padding.

Shape legend: B batch, T sequence, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from moe.integrations.hf.causal_lm import hf_model_from_config
from moe.model import ModelConfig, MoETransformer, Rotary

REMOTE_CODE = "causal_moe_hf"
"""The module name (``causal_moe_hf.py``) of a custom checkpoint's ``auto_map`` classes."""

HF_COMMON = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings")
"""The config fields transformers reads of every causal LM (``generate`` sizes its cache from them)."""


class MoETransformerConfig(PreTrainedConfig):
    """A ``MoETransformer``'s ``ModelConfig`` (``moe_config``, its fields as a dict) in a
    transformers config; the fields transformers reads (:data:`HF_COMMON`) follow from it."""

    model_type = "causal_moe"
    moe_config: dict | None = None

    def __post_init__(self, **kwargs) -> None:
        cfg = ModelConfig(**(self.moe_config or {}))
        self.moe_config = dataclasses.asdict(cfg)
        values = (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.max_seq_len)
        for name, value in zip(HF_COMMON, values):
            setattr(self, name, value)
        self.tie_word_embeddings = cfg.tie_embeddings
        super().__post_init__(**kwargs)


class SwappedMoEConfig(PreTrainedConfig):
    """A transformers model's config (``base_config``, its ``to_dict()``) and the router (with its
    options) that every sparse MoE block of it routes with (``moe.integrations.hf.swap_moe_blocks``)."""

    model_type = "causal_moe_swapped"
    base_config: dict | None = None
    router: str = "topk"
    router_options: dict | None = None

    def __post_init__(self, **kwargs) -> None:
        base = self.base_config or {}
        for name in HF_COMMON:
            if name in base:
                setattr(self, name, base[name])
        self.router_options = dict(self.router_options or {})
        self.tie_word_embeddings = False  # the wrapped model ties its own
        super().__post_init__(**kwargs)


def check_inputs(input_ids: Tensor | None, attention_mask: Tensor | None) -> None:
    """ValueError for what the recomputing classes do not take: no ``input_ids``, or padding."""
    if input_ids is None:
        raise ValueError("this model takes input_ids (inputs_embeds are not supported)")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("padded batches are not supported: give prompts of equal length (attention_mask all ones)")


class RecomputingCausalLM(PreTrainedModel, GenerationMixin):
    """What both classes share: ``forward`` computes every position of ``input_ids`` afresh
    (loss as transformers computes it from ``labels``), and ``generate`` hands it the whole
    sequence at every step."""

    base_model_prefix = "model"

    def logits(self, input_ids: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        check_inputs(input_ids, attention_mask)
        logits_BTV = self.logits(input_ids)
        loss = None if labels is None else self.loss_function(logits_BTV, labels, self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits_BTV)

    def prepare_inputs_for_generation(self, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs) -> dict:
        return {"input_ids": input_ids, "attention_mask": attention_mask}


class MoETransformerForCausalLM(RecomputingCausalLM):
    """``MoETransformer`` (``self.model``) as a transformers causal LM."""

    config_class = MoETransformerConfig
    _tied_weights_keys = {"model.head.weight": "model.embed.weight"}

    def __init__(self, config: MoETransformerConfig) -> None:
        super().__init__(config)
        self.model = MoETransformer(ModelConfig(**config.moe_config))
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # every weight is in the checkpoint; the rotary tables are not (non-persistent buffers)
        if isinstance(module, Rotary):
            cfg = self.model.cfg
            tables = Rotary(cfg.d_model // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
            module.cos.copy_(tables.cos)
            module.sin.copy_(tables.sin)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.model.head

    def logits(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids).logits


class SwappedMoEForCausalLM(RecomputingCausalLM):
    """The transformers model of ``config.base_config`` with its MoE blocks swapped to
    ``config.router`` (``self.model``)."""

    config_class = SwappedMoEConfig

    def __init__(self, config: SwappedMoEConfig) -> None:
        super().__init__(config)
        self.model = hf_model_from_config(config.base_config, config.router, config.router_options).hf
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        pass  # every weight is in the checkpoint; the wrapped model initialises its own buffers

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def logits(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


CLASSES = {MoETransformerConfig: MoETransformerForCausalLM, SwappedMoEConfig: SwappedMoEForCausalLM}
"""Config class -> model class, as registered with transformers' auto classes."""


def register() -> None:
    """Make ``AutoConfig`` and ``AutoModelForCausalLM`` know :data:`CLASSES` (done on import)."""
    for config_class, model_class in CLASSES.items():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)


register()
