"""The training command line, generated from the config dataclasses (``--seq-len`` for
``TrainConfig.seq_len``, ``--d-model`` for ``ModelConfig.d_model``)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from dataclasses import fields

from moe.model import ModelConfig
from moe.training.config import TrainConfig
from moe.training.loop import TrainResult, train


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


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
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        options[key.strip()] = parse_value(value.strip())
    return options


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, skip: set[str] = frozenset(),
                       dest_prefix: str = "", defaults_none: bool = False) -> None:
    """One flag per field of ``cls`` (``--seq-len``), typed and documented from the dataclass.
    With ``defaults_none`` every default is None (meaning: keep the value from elsewhere)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in fields(cls):
        if f.name in skip:
            continue
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
        if base not in (int, float, str, bool):
            continue
        default = None if defaults_none else (f.default if f.default is not dataclasses.MISSING else f.default_factory())
        kwargs = {"dest": dest_prefix + f.name, "default": default, "metavar": f.name.upper(), "help": f"{docs.get(f.name, '')} (default: {default})".replace("%", "%%")}
        flag = "--" + f.name.replace("_", "-")
        if base is bool:
            del kwargs["metavar"]
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            parser.add_argument(flag, type=base, **kwargs)


MODEL_PREFIX = "model__"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train a small MoE language model with any router (single process or torchrun data parallel).",
    )
    add_dataclass_args(parser, TrainConfig, skip={"router_options", "model"})
    parser.add_argument("--router-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a router option, repeatable: --router-option top_k=2 --router-option capacity_factor=1.0")
    group = parser.add_argument_group("model overrides (default: the preset's value)")
    add_dataclass_args(group, ModelConfig, skip={"vocab_size", "router", "router_options"}, dest_prefix=MODEL_PREFIX,
                       defaults_none=True)
    return parser


def config_from_args(argv: list[str] | None = None) -> TrainConfig:
    ns = vars(build_parser().parse_args(argv))
    router_options = parse_options(ns.pop("router_option"))
    model = {k[len(MODEL_PREFIX):]: v for k, v in list(ns.items()) if k.startswith(MODEL_PREFIX)}
    for k in list(ns):
        if k.startswith(MODEL_PREFIX):
            del ns[k]
    return TrainConfig(**ns, router_options=router_options, model={k: v for k, v in model.items() if v is not None})


def main(argv: list[str] | None = None) -> TrainResult:
    return train(config_from_args(argv))
