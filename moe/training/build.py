"""The model section of a run and the model it builds: the preset, its router and overrides
(:class:`ModelSection`), the resolved :class:`~moe.model.ModelConfig` and the initialised model."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field, fields
from typing import Annotated, Any

import torch
import torch.distributed as dist
import tyro
import tyro._docstrings
from torch import nn

from moe.model import PRESETS, ModelConfig, MoETransformer, preset
from moe.parallel.materialize import FromSource, materialize, parameters_on_meta
from moe.routers import build_router
from moe.routing import registered_routers

FIXED = ("vocab_size", "router", "router_options")
"""ModelConfig fields a run does not override: the data sets the vocabulary, the section the router."""


def parse_value(text: str):
    """A command-line value as int, float, bool (true/false) or str, in that order."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_options(items: list[str]) -> dict:
    """``["top_k=2", "capacity_factor=1.0"]`` -> ``{"top_k": 2, "capacity_factor": 1.0}``."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        options[key.strip()] = parse_value(value.strip())
    return options


ROUTER_OPTION = tyro.constructors.PrimitiveConstructorSpec(
    nargs=1,
    metavar="KEY=VALUE",
    instance_from_str=parse_options,
    is_instance=lambda v: isinstance(v, dict),
    str_from_instance=lambda d: [f"{k}={v}" for k, v in d.items()],
    _action="append",
)
"""``--router-option top_k=2 --router-option capacity_factor=1.0`` on the command line -> a dict."""


def _override_field(f: dataclasses.Field) -> tuple:
    # tyro reads a field's docstring from its class's source; this class is generated, so the
    # help is ModelConfig's docstring of the field, read by tyro's own reader.
    described = tyro._docstrings.get_field_docstring(ModelConfig, f.name, ())
    doc = f"{described or ''} None: the preset's value.".strip()
    hint = typing.get_type_hints(ModelConfig)[f.name]
    return f.name, Annotated[hint | None, tyro.conf.arg(help=doc)], field(default=None)


ModelOverrides = dataclasses.make_dataclass(
    "ModelOverrides",
    [_override_field(f) for f in fields(ModelConfig) if f.name not in FIXED],
)
ModelOverrides.__doc__ = (
    "Every ModelConfig field but vocab_size and the router, None = the preset's value "
    "(generated from ModelConfig: ``--d-model 128``)."
)


@dataclass
class ModelSection:
    """What model a run trains."""

    preset: str = "tiny"
    """Model preset (``moe.model.PRESETS``)."""
    router: str = "topk"
    """Router name (``moe.list_routers()``)."""
    router_options: Annotated[dict[str, Any], ROUTER_OPTION, tyro.conf.arg(name="router-option")] = field(
        default_factory=dict
    )
    """Router options, e.g. ``{"top_k": 2}``; on the command line ``--router-option top_k=2`` (repeatable)."""
    overrides: ModelOverrides = field(default_factory=ModelOverrides)
    """Overrides of the preset's ModelConfig fields."""
    hf_model: str | None = None
    """Train a Hugging Face transformers MoE model instead of the preset (needs the [hf] extra):
    a local directory (weights, or a config.json alone for random weights) or a built-in tiny
    random config (``moe.integrations.hf.TINY_CONFIGS``, e.g. olmoe-tiny); its MoE blocks route
    with ``router`` (topk without options keeps the family's own routing). Never downloads."""

    def __post_init__(self) -> None:
        if isinstance(self.overrides, dict):  # from TOML or keyword arguments
            known = {f.name for f in fields(ModelOverrides)}
            bad = set(self.overrides) - known
            if bad:
                raise ValueError(f"unknown model overrides {sorted(bad)}; known: {sorted(known)}")
            self.overrides = ModelOverrides(**self.overrides)
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; known presets: {', '.join(PRESETS)}")
        if self.router not in registered_routers():
            raise ValueError(
                f"unknown router {self.router!r}; known routers: {', '.join(sorted(registered_routers()))}"
            )
        if not self.hf_model:  # the options of a router that does not build fail here, not mid-setup
            with torch.device("meta"):
                build_router(self.router, d_model=8, num_experts=self.num_experts(), **self.router_options)
        if self.hf_model and set(self.given()) - {"backend"}:
            raise ValueError(
                "hf_model takes its architecture from its transformers config: no model overrides (except backend)"
            )

    def num_experts(self) -> int:
        """E of the preset, or of its override."""
        return self.overrides.num_experts or PRESETS[self.preset].num_experts

    def max_seq_len(self) -> int:
        """The longest sequence the model covers: the preset's, or its override."""
        return self.overrides.max_seq_len or PRESETS[self.preset].max_seq_len

    def given(self) -> dict:
        """The overrides that were set (field -> value)."""
        return {k: v for k, v in dataclasses.asdict(self.overrides).items() if v is not None}


def model_config(section: ModelSection, vocab_size: int) -> ModelConfig:
    """The preset with the run's router, vocabulary and overrides. Router options follow ``moe.model.preset``'s rule: the preset's carry over only to the
    preset's own router, and the run's are merged on top. A ``d_ff`` override on a model
    without dense blocks is refused: it would change nothing (the expert width is ``moe_d_ff``)."""
    overrides = section.given()
    mcfg = preset(
        section.preset,
        vocab_size=vocab_size,
        router=section.router,
        router_options=dict(section.router_options),
        **overrides,
    )
    if "d_ff" in overrides and not mcfg.uses_d_ff():
        raise ValueError(
            f"d_ff={overrides['d_ff']} has no effect: every block is an MoE block (moe_every="
            f"{mcfg.moe_every}); the expert width is moe_d_ff (--moe-d-ff), or make some blocks dense "
            "with --moe-every N > 1"
        )
    return mcfg


def build_model(
    mcfg: ModelConfig, seed: int, device: torch.device, expert_parallel=None, materialized: bool = True
) -> MoETransformer:
    """The model, initialised from ``seed`` (``init_seed``: every parameter drawn whole from a
    generator seeded by it and the parameter's name) on ``device``. It is built on the meta
    device and then materialised, so with ``expert_parallel`` (a ``moe.parallel.ExpertParallel``)
    this rank allocates and fills only its own experts, with the single-process values.
    ``materialized=False`` leaves the parameters on the meta device for a placement that shards
    first and then calls ``moe.parallel.materialize.materialize(model, device, model.init_parameter)``."""
    torch.manual_seed(seed)
    with parameters_on_meta():
        model = MoETransformer(mcfg, expert_parallel=expert_parallel, init_seed=seed)
    if materialized:
        materialize(model, device, model.init_parameter)
    return model


def build_run_model(
    section: ModelSection, mcfg: ModelConfig, seed: int, device: torch.device, world_size: int, expert_parallel=None
) -> nn.Module:
    """The model a run trains, its parameters left on the meta device for the placement to
    shard and materialise with ``model.init_parameter``: the preset's (:func:`build_model`), or,
    with ``hf_model``, the swapped transformers model. That one is built whole on rank 0 only,
    exactly as one process builds it (its own initialiser, or its weights from disk), and
    ``init_parameter`` broadcasts it one parameter at a time (``moe.parallel.materialize.FromSource``)."""
    if not section.hf_model:
        return build_model(mcfg, seed, device, expert_parallel, materialized=False)
    from moe.integrations.hf import build_hf_model  # the [hf] extra, imported only when asked for

    def swapped(ep=None, weights=True) -> nn.Module:
        return build_hf_model(
            section.hf_model, section.router, section.router_options, mcfg.vocab_size, seed, mcfg.backend, ep, weights
        )

    source = swapped() if world_size == 1 or dist.get_rank() == 0 else None
    with parameters_on_meta():
        model = swapped(expert_parallel, weights=False)
    model.init_parameter = FromSource(source, device if device.type == "cuda" else "cpu")
    return model


def total_parameters(mcfg: ModelConfig) -> int:
    """Parameters of the whole model (whatever the layout: counted on the meta device)."""
    with torch.device("meta"):
        return MoETransformer(mcfg).num_parameters()


def hf_recipe(section: ModelSection, model: nn.Module, backend: str) -> dict | None:
    """What rebuilds the swapped Hugging Face model of a run (``moe.integrations.hf.hf_model_from_config``'s
    arguments: its transformers config as a dict, the router, its options, the backend); None
    for the preset model."""
    if not section.hf_model:
        return None
    return dict(
        config=model.hf.config.to_dict(),
        router=section.router,
        router_options=dict(section.router_options),
        backend=backend,
    )
