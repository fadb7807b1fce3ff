"""Find the sparse MoE blocks of the installed Hugging Face transformers and build each one tiny.

Shape legend: B batch, T sequence, D hidden size, V vocabulary, E experts, K experts per token.

Discovery reads the source of every ``transformers/models/*/modeling_*.py``: a class is a sparse
MoE block when its body assigns experts (``self.experts = ...``) next to a router
(``self.gate`` / ``self.router`` / ``self.gating`` ...), or when its name ends like one
(``...MoE``, ``...SparseMLP``) and it assigns a router. Building imports the module, takes its
family's config with the attributes of :data:`TINY` shrunk, initialises every parameter at
random (seeded; standalone blocks are created with ``torch.empty``) and wraps the block so that
it maps x_BTD to y_BTD. Blocks with a token capacity get one that binds at the audited shape
(:func:`capacity_overrides`). Nothing is downloaded: ``HF_HUB_OFFLINE`` is set before
transformers is imported. transformers is imported here only, lazily (``pip install -e '.[zoo]'``).
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from moe.audit.target import AuditUsageError

BATCH, SEQ, D_MODEL, D_FF, EXPERTS, TOP_K = 2, 8, 16, 32, 4, 2
"""The audited shape (x_BTD) and the tiny config every block is built from."""
VOCAB, LAYERS = 64, 2
"""Vocabulary and depth of the whole causal LMs."""
LM_FAMILIES = ("mixtral", "olmoe", "qwen2_moe", "deepseek_v3", "gpt_oss")
"""Families also audited as a whole causal LM on token ids (when the installed version has them)."""

TINY: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "d_model"), D_MODEL),
    **dict.fromkeys(
        (
            "intermediate_size",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "shared_intermediate_size",
            "moe_shared_expert_intermediate_size",
            "shared_experts_intermediate_size",
            "expert_ffn_hidden_size",
            "ffn_hidden_size",
            "d_ff",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "dense_intermediate_size",
        ),
        D_FF,
    ),
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"), EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts", "moe_top_k"), TOP_K),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts"), 1),
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 0,
    "decoder_sparse_step": 1,
}
"""Config attributes shrunk for the zoo, set where a config (or a nested one) has them as None
or an int; every other attribute keeps the library's default."""
TINY_LM: dict[str, int] = {
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
}
"""Added to :data:`TINY` for the whole causal LMs (blocks keep the default depth, so that the
last layer, which every family makes sparse, is the one built)."""
TRAIN_NOISE_KEYS = ("router_jitter_noise", "input_jitter_noise", "moe_jitter_eps", "jitter_noise", "moe_token_dropout")
"""Config knobs that make a block random in training mode when > 0 (besides nn.Dropout)."""

_PRIORITY = "priority: score if batch_prioritized_routing, else position"
"""Replaced by the priority the built config uses."""
ROUTER_MARKS: list[tuple[str, str]] = [
    (r"\bsoftmax\(", "softmax scores"),
    (r"\bsigmoid\(", "sigmoid scores"),
    (r"scoring_func", "score function from config.scoring_func"),
    (r"expert_capacity", "capacity"),
    (r"cumsum\(\w+, dim=-2\)", "slots in position order per sequence (cumsum over T)"),
    (r"cumsum\(\w+, dim=0\)", "slots counted over the flattened batch (cumsum over B*T)"),
    (r"batch_prioritized_routing", _PRIORITY),
    (r"capacity_token_fraction \* nb_tokens", "eval capacity = fraction x tokens in the forward"),
    (r"locations2\s*\+=", "second choices queued after all first choices"),
    (r"\btopk_group\b|\bn_group\b", "group-limited"),
    (r"e_score_correction_bias|expert_bias", "score-correction bias"),
    (r"sparsemixer", "Gumbel-sampled in training (sparsemixer)"),
    (r"[Gg]umbel|multinomial|rand_like\(|bernoulli", "sampled second expert (option)"),
    (r"jitter", "input jitter in training (if configured)"),
    (r"\.view\(2,\s*\w+\s*\*\s*\w+", "router logits split across the token axis by a view"),
    (r"shared_expert", "shared expert(s)"),
    (r"zero_expert", "zero (identity) experts"),
]
"""(regex over the routing code, what it marks) for the router kind; the first two are the
score function, read from the router submodule when it has one."""

_CLASS = re.compile(r"^class (\w+)\(", re.M)
_EXPERTS = re.compile(r"self\.experts\s*=")
_ROUTER = re.compile(r"self\.(gate|router|gating|switch|moe_router|mlp_router)\w*\s*=")
_MOE_NAME = re.compile(r"(MoE|Moe|MoA|SparseMLP|SparseMoeBlock)$")
_ROUTER_STRICT = re.compile(r"self\.(router|gate|gating)(_gate)?\s*=")


@dataclass
class ZooEntry:
    """One block class (or whole causal LM) of the zoo, found but not built."""

    family: str
    """transformers model type (its folder under ``transformers/models``), e.g. "mixtral"."""
    cls_name: str
    """The block class, or the ``*ForCausalLM`` class."""
    kind: str
    """"block" (float x_BTD in) or "causal LM" (token ids in)."""
    module: str
    """The module that defines the class."""

    @property
    def name(self) -> str:
        return f"{self.family}.{self.cls_name}"


@dataclass
class Built:
    """A zoo entry, built: how to make the target, and what its code and config say."""

    make: Callable[[], nn.Module]
    """A fresh wrapped, initialised target (identical on every call)."""
    router_kind: str
    """What its routing code does, from :data:`ROUTER_MARKS` and the top-k / argmax it calls."""
    capacity: str | None
    """The capacity settings used (None: the block has no capacity)."""
    train_noise: str | None
    """What makes it random in training mode (dropout, jitter), None if nothing."""
    note: str | None = None
    """How the audited code was reached, where the library's own module cannot run here."""


def transformers_module() -> Any:
    """transformers, imported offline; a usage error when it is not installed."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise AuditUsageError("the zoo needs Hugging Face transformers: pip install -e '.[zoo]'") from None
    return transformers


def discover(families: Iterable[str] | None = None) -> list[ZooEntry]:
    """Every sparse MoE block class in the installed transformers (in family order), then the
    :data:`LM_FAMILIES` causal LMs; only those of ``families`` when given. Reads source only."""
    transformers = transformers_module()
    keep = None if families is None else set(families)
    entries = []
    for path in sorted((Path(transformers.__file__).parent / "models").glob("*/modeling_*.py")):
        family = path.parent.name
        if keep is None or family in keep:
            module = f"transformers.models.{family}.{path.stem}"
            entries += [ZooEntry(family, name, "block", module) for name in moe_block_names(path.read_text())]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for family in LM_FAMILIES:
        if family in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and (keep is None or family in keep):
            entries.append(ZooEntry(family, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family], "causal LM", "transformers"))
    return entries


def moe_block_names(source: str) -> list[str]:
    """Classes in a modeling file whose body assigns both experts and a router, or whose name
    ends like an MoE block (``...MoE``, ``...SparseMLP``, ...) and that assign a router (experts
    may then be parallel linears or embeddings: JetMoE, Doge)."""
    starts = [(m.start(), m.group(1)) for m in _CLASS.finditer(source)]
    ends = [s for s, _ in starts[1:]] + [len(source)]
    out = []
    for (start, name), end in zip(starts, ends):
        body = source[start:end]
        if (_EXPERTS.search(body) and _ROUTER.search(body)) or (_MOE_NAME.search(name) and _ROUTER_STRICT.search(body)):
            out.append(name)
    return out


def build(entry: ZooEntry) -> Built:
    """Import and build ``entry``; raises (with the reason) when it cannot be built."""
    transformers_module()
    cls = getattr(importlib.import_module(entry.module), entry.cls_name)
    if entry.kind == "causal LM":
        config = _tiny_config(
            cls.config_class, {**TINY, **TINY_LM}, _counts_per_sequence(importlib.import_module(cls.__module__))
        )
        config._attn_implementation = "eager"
        probe = cls(config)

        def make() -> nn.Module:
            return _LMAdapter(init_parameters(cls(config)))

    else:
        if "position_embeddings" in inspect.signature(cls.forward).parameters:
            raise AuditUsageError(
                "a decoder layer with its MoE inline: its forward needs attention inputs (position_embeddings), "
                "so there is no standalone MoE block to audit"
            )
        module = importlib.import_module(entry.module)
        probe, config = _build_block(cls, _config_classes(module, entry.family), _counts_per_sequence(module))

        def make() -> nn.Module:
            return _BlockAdapter(init_parameters(cls(**_init_args(cls, config))))

    kind = router_kind(probe)
    prioritized = [c.batch_prioritized_routing for c in _configs_in(config) if hasattr(c, "batch_prioritized_routing")]
    if prioritized:
        kind = kind.replace(
            _PRIORITY,
            f"priority: {'score' if prioritized[0] else 'position'} (batch_prioritized_routing={prioritized[0]})",
        )
    return Built(make, kind, _capacity_text(config), _train_noise(probe, config))


def _config_classes(module: Any, family: str) -> list[type]:
    """Config classes of the family, the text ones first (MoE blocks live in the text model)."""
    from transformers import PreTrainedConfig

    found = {
        v
        for v in vars(module).values()
        if isinstance(v, type)
        and issubclass(v, PreTrainedConfig)
        and v.__module__.startswith(f"transformers.models.{family}.")
    }
    if not found:
        raise AuditUsageError(f"no config class in transformers.models.{family}")
    return sorted(found, key=lambda c: ("Text" not in c.__name__, c.__name__))


def _build_block(cls: type, configs: list[type], per_sequence: bool) -> tuple[nn.Module, Any]:
    """The block built from the first config class that works (parameters not initialised)."""
    errors = []
    for config_cls in configs:
        try:
            cfg = _tiny_config(config_cls, TINY, per_sequence)
            return cls(**_init_args(cls, cfg)), cfg
        except Exception as e:  # try the family's next config class; all failures form the reason
            errors.append(f"{config_cls.__name__}: {reason(e)}")
    raise AuditUsageError("; ".join(errors))


def _tiny_config(config_cls: type, tiny: dict[str, int], per_sequence: bool) -> Any:
    """The default config with :data:`TINY` and binding capacities applied, experts and attention
    in their eager (reference loop) implementations."""
    cfg = config_cls()
    cfg._experts_implementation = "eager"
    for sub in _configs_in(cfg):
        for key, value in {**tiny, **capacity_overrides(sub, per_sequence)}.items():
            try:
                current = getattr(sub, key, None)
            except Exception:  # per-layer attributes of some configs refuse a global read
                continue
            if current is None or (isinstance(current, type(value)) and not isinstance(current, bool)):
                setattr(sub, key, value)
    return cfg


def _configs_in(cfg: Any) -> Iterator[Any]:
    """The config and every config nested in it (text_config, ffn_config, ...)."""
    from transformers import PreTrainedConfig

    yield cfg
    for value in vars(cfg).values():
        if isinstance(value, PreTrainedConfig):
            yield from _configs_in(value)


def _counts_per_sequence(source_of: Any) -> bool:
    """Does the routing code count capacity slots per sequence (a cumsum over dim -2 of
    [B, T, E], as Switch does) rather than over the flattened batch?"""
    return bool(re.search(r"cumsum\(\w+, dim=-2\)", _source(source_of)))


def capacity_overrides(cfg: Any, per_sequence: bool) -> dict[str, int | float]:
    """Token capacities that bind at the audited shape: half an expert's even share of the K
    choices of the tokens the code counts over (T per sequence, else B*T), as a count
    (``expert_capacity``), and half the even share as a fraction of the forward's tokens
    (``moe_eval_capacity_token_fraction``)."""
    out: dict[str, int | float] = {}
    if hasattr(cfg, "expert_capacity"):
        out["expert_capacity"] = max(1, (1 if per_sequence else BATCH) * SEQ * TOP_K // (2 * EXPERTS))
    if hasattr(cfg, "moe_eval_capacity_token_fraction"):
        out["moe_eval_capacity_token_fraction"] = TOP_K / (2 * EXPERTS)
    return out


def _capacity_text(cfg: Any) -> str | None:
    used = {k: getattr(sub, k) for sub in _configs_in(cfg) for k in capacity_overrides(sub, False)}
    return ", ".join(f"{k}={v}" for k, v in used.items()) or None


def _train_noise(module: nn.Module, cfg: Any) -> str | None:
    drop = sorted({m.p for m in module.modules() if isinstance(m, nn.Dropout) and m.p > 0})
    knobs = [
        f"{k}={getattr(sub, k)}" for sub in _configs_in(cfg) for k in TRAIN_NOISE_KEYS if (getattr(sub, k, 0) or 0) > 0
    ]
    parts = ([f"dropout {','.join(str(p) for p in drop)}"] if drop else []) + knobs
    return ", ".join(parts) or None


def _init_args(cls: type, cfg: Any) -> dict[str, Any]:
    """Constructor arguments: the config, the last layer's index (sparse in every family: dense
    and hash-routed layers come first), an FFN width; other parameters must have defaults."""
    args: dict[str, Any] = {}
    for name, p in list(inspect.signature(cls.__init__).parameters.items())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name == "config":
            args[name] = cfg
        elif name in ("layer_idx", "layer_id", "layer_number"):
            args[name] = getattr(cfg, "num_hidden_layers", 2) - 1
        elif name in ("ffn_dim", "intermediate_size"):
            args[name] = D_FF
        elif p.default is p.empty:
            raise AuditUsageError(f"the constructor needs {name!r}, which a config alone does not give")
    return args


def init_parameters(module: nn.Module) -> nn.Module:
    """Seeded random init of every parameter: matrices N(0, 1/fan_in), norm-like vectors 1,
    other vectors N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            elif "norm" in name or name.endswith("scale"):
                p.fill_(1.0)
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return module


def router_kind(module: nn.Module) -> str:
    """What the routing code of ``module`` does: the selection (top-k / argmax) and score function
    from its router submodules (children named gate / router / gating), else from the MoE block
    itself; the other :data:`ROUTER_MARKS` from both. Experts and shared-expert MLPs are not read."""
    blocks = [m for m in module.modules() if type(m).__name__ in moe_block_names(_source(type(m)))] or [module]
    routers = [
        c for b in blocks for n, c in b.named_children() if re.search(r"gate|router|gating", n) and "shared" not in n
    ]
    block_src = _sources(type(b) for b in blocks)
    router_src = _sources(type(r) for r in routers)
    select_src = router_src if re.search(r"topk\(|argmax\(", router_src) else block_src
    score_src = router_src if re.search(r"softmax\(|sigmoid\(", router_src) else block_src
    select = (
        "top-k"
        if "topk(" in select_src
        else "top-2 (two argmaxes)"
        if select_src.count("argmax(") >= 2
        else "top-1 (argmax)"
        if "argmax(" in select_src
        else "top-2 by repeated max (sparsemixer)"
        if "sparsemixer(" in block_src + router_src
        else "selection not recognised"
    )
    scores = [label for pattern, label in ROUTER_MARKS[:2] if re.search(pattern, score_src)]
    marks = [label for pattern, label in ROUTER_MARKS[2:] if re.search(pattern, block_src + router_src)]
    return "; ".join([select, *scores, *marks])


def _sources(classes: Iterable[type]) -> str:
    return "".join(_source(c) for c in dict.fromkeys(classes) if c.__module__.startswith("transformers."))


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def reason(e: BaseException) -> str:
    """One line saying why something failed (at most 300 characters)."""
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def example_for(entry: ZooEntry, seed: int = 0) -> Tensor:
    """The audited input: x_BTD ~ N(0, 1) for blocks, ids_BT below V for causal LMs."""
    gen = torch.Generator().manual_seed(seed)
    if entry.kind == "causal LM":
        return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return torch.randn(BATCH, SEQ, D_MODEL, generator=gen)


class _BlockAdapter(nn.Module):
    """x_BTD -> the block's outputs: its hidden output as y_BTD (some blocks return it flat, as
    [B*T, D]), then whatever else it returns (router logits or scores, often flat [B*T, E]),
    each read by the audit by its shape, as a user's own target's outputs are.

    Each call hands the block a fresh contiguous copy, as a model would: blocks ``.view()`` and
    scale their input in place (router jitter)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x_BTD: Tensor) -> Tensor | tuple:
        out = self.block(x_BTD.clone(memory_format=torch.contiguous_format))
        if not isinstance(out, (tuple, list)):
            return out.reshape(x_BTD.shape)
        hidden, *rest = out
        return (hidden.reshape(x_BTD.shape), *rest)


def hidden_output(out: Tensor | tuple) -> Tensor:
    """The hidden output y_BTD of what a zoo target returns."""
    return out[0] if isinstance(out, tuple) else out


class _LMAdapter(nn.Module):
    """ids_BT -> a causal LM's output (no cache): its logits and every layer's router logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids_BT: Tensor) -> Any:
        return self.model(input_ids=ids_BT.contiguous(), use_cache=False, output_router_logits=True)
