"""Export a model trained here as a Hugging Face checkpoint folder (``save_pretrained``'s layout:
``config.json``, ``model.safetensors``, ``generation_config.json``) that
``transformers.AutoModelForCausalLM.from_pretrained`` loads and generates from.

Where a transformers architecture computes what the model computes, the folder is that
architecture and needs no code of ours: a ``MoETransformer`` whose every block routes with a
softmax top-k renormalised, with no shared experts, is a Mixtral (:mod:`moe.integrations.hf.mixtral`);
a swapped model (``--hf-model``) whose routers still route as its family's gates route is its
own architecture again. Everything else is written as one of the two classes of
:mod:`moe.integrations.hf.pretrained`, with an ``auto_map`` and the module ``causal_moe_hf.py``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from moe.integrations.hf.blocks import FAMILIES, HFMoEBlock, swap_moe_blocks
from moe.integrations.hf.causal_lm import HFCausalLM
from moe.integrations.hf.mixtral import EXACT_ROUTER_DTYPES, mixtral_mismatch, to_mixtral
from moe.integrations.hf.pretrained import (
    REMOTE_CODE,
    MoETransformerConfig,
    MoETransformerForCausalLM,
    SwappedMoEConfig,
    SwappedMoEForCausalLM,
)
from moe.model import MoETransformer
from moe.routers import TopKRouter

ARCHITECTURES = ("auto", "native", "custom")
"""``export_pretrained(architecture=)``: native where exact, else custom; native or refuse; custom."""

ROUTER_FIELDS = (
    "top_k",
    "gate_fn",
    "pre_softmax",
    "normalize",
    "route_scale",
    "num_expert_groups",
    "num_limited_groups",
    "null_experts",
)
"""What a swapped ``topk`` router must share with its family's own to route as the family does."""


def export_pretrained(model: nn.Module, folder: str | Path, *, architecture: str = "auto") -> str:
    """Write ``model`` (a ``MoETransformer``, an ``HFCausalLM``, a transformers model with
    swapped MoE blocks, or one of :mod:`moe.integrations.hf.pretrained`'s classes) to ``folder``
    as a Hugging Face checkpoint; return the class written (``"MixtralForCausalLM"``,
    ``"OlmoeForCausalLM"``, ``"MoETransformerForCausalLM"``, ``"SwappedMoEForCausalLM"``).

    ``architecture``: ``"auto"`` writes a transformers architecture where one computes what the
    model computes, else this package's class (loaded after ``import moe.integrations.hf``, or
    with ``trust_remote_code=True``); ``"native"`` refuses (ValueError, saying why) where none
    does; ``"custom"`` always writes this package's class."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {', '.join(map(repr, ARCHITECTURES))}, got {architecture!r}")
    if isinstance(model, (HFCausalLM, MoETransformerForCausalLM, SwappedMoEForCausalLM)):
        model = model.hf if isinstance(model, HFCausalLM) else model.model
    if any(getattr(m, "expert_parallel", None) is not None for m in model.modules()):
        raise ValueError(
            "the model's experts are sharded over processes: export the consolidated model "
            "(--export-model's file, moe.training.load_export)"
        )
    if isinstance(model, MoETransformer):
        reason = mixtral_mismatch(model)
        native, custom = (lambda: to_mixtral(model)), (lambda: preset_custom(model))
    else:
        if not any(isinstance(m, HFMoEBlock) for m in model.modules()):
            raise ValueError(f"{type(model).__name__} has no swapped MoE block: save it with its own save_pretrained")
        original = FreshOriginal(model)
        reason = original.mismatch(model)
        native, custom = (lambda: original.holding(model)), (lambda: swapped_custom(model))
    if architecture == "native" and reason is not None:
        raise ValueError(f"no transformers architecture computes this model: {reason}; use architecture='auto'")
    exact = architecture != "custom" and reason is None
    hf = native() if exact else custom()
    hf.generation_config = GenerationConfig(do_sample=False, **special_tokens(hf.config))
    hf.save_pretrained(folder)
    if exact:
        (Path(folder) / f"{REMOTE_CODE}.py").unlink(missing_ok=True)  # of an earlier custom export there
    else:
        write_remote_code(Path(folder), type(hf))
    return type(hf).__name__


def special_tokens(config) -> dict:
    return {k: getattr(config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def preset_custom(model: MoETransformer) -> MoETransformerForCausalLM:
    # the data path where it loads: grouped_mm on CUDA, torch elsewhere (a triton run's file loads on a CPU)
    config = MoETransformerConfig(moe_config=dataclasses.asdict(dataclasses.replace(model.cfg, backend="auto")))
    hf = MoETransformerForCausalLM(config)
    hf.model.load_state_dict(model.state_dict())
    return hf.eval()


def swapped_custom(model: PreTrainedModel) -> SwappedMoEForCausalLM:
    recipe = getattr(model, "swap_recipe", None)
    if recipe is None:
        raise ValueError(f"{type(model).__name__}'s MoE blocks were not swapped by swap_moe_blocks")
    hf = SwappedMoEForCausalLM(SwappedMoEConfig(base_config=model.config.to_dict(), **recipe))
    hf.model.load_state_dict(model.state_dict())
    return hf.eval()


class FreshOriginal:
    """A new transformers model of a swapped model's config (``model``), its MoE blocks by name
    (``blocks``), and the same model swapped to ``topk`` (``reference``), whose routers route as
    the blocks' own gates and share their weights."""

    def __init__(self, swapped: PreTrainedModel) -> None:
        config = AutoConfig.for_model(**swapped.config.to_dict())
        self.model = AutoModelForCausalLM.from_config(config, dtype=swapped.dtype)
        self.blocks = {name: m for name, m in self.model.named_modules() if type(m).__name__ in FAMILIES}
        self.reference = swap_moe_blocks(self.model, "topk")

    def mismatch(self, swapped: PreTrainedModel) -> str | None:
        """Why ``swapped``'s routers do not route as the blocks' own gates (None: they do)."""
        ours = [m.moe.router for m in swapped.modules() if isinstance(m, HFMoEBlock)]
        theirs = [m.moe.router for m in self.reference.modules() if isinstance(m, HFMoEBlock)]
        for i, (block, router, family) in enumerate(zip(self.blocks.values(), ours, theirs)):
            if type(router) is not TopKRouter:
                return f"MoE block {i}: router {router.name!r} has no transformers counterpart"
            differ = [f for f in ROUTER_FIELDS if getattr(router, f) != getattr(family, f)]
            if not FAMILIES[type(block).__name__].deepseek_gate and bool(router.balance_bias.any()):
                differ.append("balance_bias (non-zero: aux-loss-free balancing)")
            if router.router_dtype not in EXACT_ROUTER_DTYPES:
                differ.append(f"router_dtype={router.router_dtype!r}")
            if differ:
                return f"MoE block {i}: topk with {', '.join(differ)} other than its family's"
        return None

    def holding(self, swapped: PreTrainedModel) -> PreTrainedModel:
        """The original model holding ``swapped``'s weights (loaded into the parameters its
        blocks share with ``reference``), its blocks put back."""
        self.reference.load_state_dict(swapped.state_dict())
        for name, block in self.blocks.items():
            self.model.set_submodule(name, block)
        del self.model.swap_recipe
        return self.model.eval()


def write_remote_code(folder: Path, model_class: type) -> None:
    """``folder/causal_moe_hf.py`` and the config's ``auto_map``, so that ``from_pretrained(folder,
    trust_remote_code=True)`` finds this package's classes without an import first."""
    config_class = model_class.config_class
    (folder / f"{REMOTE_CODE}.py").write_text(
        '"""The classes of this checkpoint, from the causal-moe-routing package (its [hf] extra)."""\n\n'
        f"from moe.integrations.hf.pretrained import {config_class.__name__}, {model_class.__name__}\n\n"
        f'__all__ = ["{config_class.__name__}", "{model_class.__name__}"]\n'
    )
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["auto_map"] = {
        "AutoConfig": f"{REMOTE_CODE}.{config_class.__name__}",
        "AutoModelForCausalLM": f"{REMOTE_CODE}.{model_class.__name__}",
    }
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
