"""A hash block of a model (``ModelConfig.hash_layers``) takes from the model's router options
only those of the weights (``moe.routers.hash.SHARED_OPTIONS``): the balance options of the
other blocks' router are theirs alone, and a hash router refuses them."""

from __future__ import annotations

from helpers import small_lm

from moe.routers.hash import SHARED_OPTIONS, block_router

OPTIONS = {
    "top_k": 2,
    "gate": "sigmoid",
    "route_scale": 2.0,
    "z_loss_coef": 0.002,
    "aux_loss_coef": 0.05,
    "seq_aux_loss_coef": 0.01,
    "balance_rate": 1e-3,
}


def test_block_router_keeps_the_weight_options_of_a_hash_block():
    name, options = block_router("topk", OPTIONS, vocab_size=32, block=1, hashed=True)
    want = {k: v for k, v in OPTIONS.items() if k in ("top_k", "gate", "route_scale", "z_loss_coef")}
    assert name == "hash"
    assert options == {**want, "vocab_size": 32, "table_seed": 1}
    assert set(options) - {"vocab_size", "table_seed"} <= set(SHARED_OPTIONS)
    # a block that is not hashed keeps the model's router and every option, untouched
    assert block_router("topk", OPTIONS, vocab_size=32, block=1, hashed=False) == ("topk", OPTIONS)


def test_a_model_with_balance_options_builds_its_hash_block_without_them():
    first, second = small_lm("topk", OPTIONS, hash_layers=1).routers()
    assert (first.name, second.name) == ("hash", "topk")
    assert (first.gate_fn, first.top_k, first.route_scale, first.z_loss_coef) == ("sigmoid", 2, 2.0, 0.002)
    assert (first.aux_loss_coef, first.seq_aux_loss_coef, first.balance_rate) == (0.0, 0.0, 0.0)
    assert (second.aux_loss_coef, second.seq_aux_loss_coef, second.balance_rate) == (0.05, 0.01, 1e-3)
