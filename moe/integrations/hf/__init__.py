"""This package's routers inside Hugging Face transformers MoE models (the ``[hf]`` extra).

    from moe.integrations.hf import swap_moe_blocks, swapped_routings, HFCausalLM
    swap_moe_blocks(model, "ec_threshold")          # every sparse MoE block now routes with ec_threshold
    out = model(input_ids)                          # the model's own calling convention is unchanged
    aux = sum(r.aux_loss for r in swapped_routings(model))

``HFCausalLM(model)`` gives the swapped model this package's ``model(idx_BT, targets_BT)``
interface (training loop, evaluation, audit); ``build_hf_model`` is what
``experiments/train.py --hf-model`` builds. ``export_pretrained(model, folder)`` writes a model
trained here (either kind) as a Hugging Face checkpoint folder. Importing this module imports
transformers where it is installed (and registers this package's classes with its auto classes);
without it the module still imports (the swap imports transformers when it runs), and the export
names say which extra they need. The core package never imports it.
"""

from importlib.util import find_spec

from moe.extras import require
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

if find_spec("transformers") is not None:  # our auto classes subclass transformers' own
    from moe.integrations.hf.export import export_pretrained
    from moe.integrations.hf.pretrained import (
        MoETransformerConfig,
        MoETransformerForCausalLM,
        SwappedMoEConfig,
        SwappedMoEForCausalLM,
    )
else:

    def __getattr__(name: str):
        if name in __all__:  # the export names: transformers is not installed
            require("transformers", "hf", f"moe.integrations.hf.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
