"""This package's routers inside Hugging Face transformers MoE models (the ``[hf]`` extra).

    from moe.integrations.hf import swap_moe_blocks, swapped_routings, HFCausalLM
    swap_moe_blocks(model, "ec_threshold")          # every sparse MoE block now routes with ec_threshold
    out = model(input_ids)                          # the model's own calling convention is unchanged
    aux = sum(r.aux_loss for r in swapped_routings(model))

``HFCausalLM(model)`` gives the swapped model this package's ``model(idx_BT, targets_BT)``
interface (training loop, evaluation, audit); ``build_hf_model`` is what
``experiments/train.py --hf-model`` builds. ``export_pretrained(model, folder)`` writes a model
trained here (either kind) as a Hugging Face checkpoint folder. Importing this module imports
transformers (and registers this package's classes with its auto classes); the core package
never does.
"""

from moe.integrations.hf.blocks import (
    FAMILIES,
    Family,
    HFMoEBlock,
    decoding,
    family_router_options,
    swap_moe_blocks,
    swapped_routings,
)
from moe.integrations.hf.causal_lm import (
    TINY_CONFIGS,
    HFCache,
    HFCausalLM,
    build_hf_model,
    hf_model_from_config,
    load_hf_model,
    tiny_config,
)
from moe.integrations.hf.export import export_pretrained
from moe.integrations.hf.pretrained import (
    MoETransformerConfig,
    MoETransformerForCausalLM,
    SwappedMoEConfig,
    SwappedMoEForCausalLM,
)

__all__ = [
    "FAMILIES",
    "Family",
    "HFCache",
    "HFCausalLM",
    "HFMoEBlock",
    "MoETransformerConfig",
    "MoETransformerForCausalLM",
    "SwappedMoEConfig",
    "SwappedMoEForCausalLM",
    "TINY_CONFIGS",
    "build_hf_model",
    "decoding",
    "export_pretrained",
    "family_router_options",
    "hf_model_from_config",
    "load_hf_model",
    "swap_moe_blocks",
    "swapped_routings",
    "tiny_config",
]
