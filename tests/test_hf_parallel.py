"""A swapped transformers model (``--hf-model``) on more than one process equals one process.

Rank 0 alone builds the model as one process builds it (the family's own initialiser, drawn
from the seed); every rank builds it on the meta device, places it (FSDP2, or expert parallel
with each swapped block keeping its experts' slice) and receives its shards from rank 0
(``moe.parallel.materialize.FromSource``). So the placed weights, gathered, are the
single-process weights bitwise; the per-step loss, aux loss and gradient norm then equal the
single-process run's to 1e-5 relative (measured: ~4e-7, fp32 sums over shards in another
order), and a run resumed from a sharded checkpoint continues the uninterrupted one exactly.
Qwen2-MoE (a shared expert beside the routed ones) with ``ec_threshold`` (router state synced
over the data-parallel ranks).
"""

from __future__ import annotations

import pytest
import torch
from extras import need
from helpers import HF_RUN
from test_materialize import assert_same_state

from moe.data import load_corpus
from moe.integrations.hf import build_hf_model
from moe.integrations.hf.blocks import HFMoEBlock
from moe.parallel import full_state_dict
from moe.parallel.launch import ok_values, run_local
from moe.parallel.materialize import FromSource
from moe.training import TrainConfig, load_export, train
from moe.training.distributed import setup_distributed
from moe.training.loop import prepare, run

need("transformers", "hf")

MODEL, ROUTER, SEED = "qwen2-moe-tiny", "ec_threshold", 5
COMMON = dict(hf_model=MODEL, router=ROUTER, seed=SEED, steps=6, wandb_mode="disabled", **HF_RUN)
LAYOUTS = {"fsdp2": dict(expert_parallel=1), "ep2": dict(expert_parallel=2)}
KEYS = ("loss", "aux_loss", "grad_norm")
REL_TOL = 1e-5


def corpus():
    return load_corpus("stdlib", 0.1, 100_000)


def curves(history: list[dict]) -> list[tuple[float, ...]]:
    return [tuple(r[k] for k in KEYS) for r in history]


def _worker(rank: int, world: int, checkpoint_dir: str) -> dict:
    out = {}
    for name, layout in LAYOUTS.items():
        cfg = TrainConfig.flat(**COMMON, **layout)
        session = prepare(cfg, corpus(), setup_distributed("cpu"))
        placed = full_state_dict(session.place.model)
        out[name] = {"placed": placed if rank == 0 else None, "curves": curves(run(session).history)}
    # a sharded checkpoint at step 3 of the FSDP2 run (of its 6-step schedule: interrupted), resumed to step 6
    ckpt = dict(checkpoint_dir=checkpoint_dir, checkpoint_every=3)
    train(TrainConfig.flat(**{**COMMON, "steps": 3, "schedule_steps": 6}, **ckpt), corpus())
    out["resumed"] = curves(train(TrainConfig.flat(**COMMON, **ckpt, resume=True), corpus()).history)
    return out


def test_hf_model_on_two_processes_is_the_single_process_model(tmp_path):
    want = build_hf_model(MODEL, ROUTER, {}, corpus().vocab_size, SEED).state_dict()
    ref = curves(train(TrainConfig.flat(**COMMON), corpus()).history)
    per_rank = ok_values(run_local(_worker, 2, str(tmp_path), timeout_s=600))
    for name in LAYOUTS:
        assert_same_state(per_rank[0][name]["placed"], want, f"{name} placed")
        got = per_rank[0][name]["curves"]  # rank 0 keeps the history
        assert len(got) == len(ref) == COMMON["steps"]
        for step, (g, w) in enumerate(zip(got, ref), 1):
            for key, a, b in zip(KEYS, g, w):
                assert abs(a - b) <= REL_TOL * abs(b), f"{name} step {step} {key}: {a!r} vs {b!r}"
    assert per_rank[0]["resumed"] == per_rank[0]["fsdp2"]["curves"][3:], "resumed run differs from uninterrupted"


def test_from_source_refuses_a_source_on_the_wrong_rank_and_a_wrong_shape():
    model = torch.nn.Linear(3, 2, bias=False)
    with pytest.raises(ValueError, match="rank 0 must hold the source model"):
        FromSource(None)
    fill = FromSource(model)
    with pytest.raises(ValueError, match=r"'weight' is \(2, 3\) in the source, \(3, 2\) here"):
        fill("weight", torch.empty(3, 2))
    with pytest.raises(ValueError, match="no parameter 'bias'"):
        fill("bias", torch.empty(2))


DEEPSEEK = dict(
    hf_model="deepseek-v3-tiny",
    router="topk",
    router_options={"balance_rate": 0.01, "seq_aux_loss_coef": 1e-4},
    seed=3,
    steps=4,
    wandb_mode="disabled",
    **HF_RUN,
)
"""The tiny DeepSeek-V3 swapped for ours: sigmoid scores, 2 of 4 expert groups per token, its
e_score_correction_bias as our balance bias, trained loss-free, and a shared expert."""


def balance_biases(model: torch.nn.Module) -> list[torch.Tensor]:
    return [m.moe.router.balance_bias.detach().clone() for m in model.modules() if isinstance(m, HFMoEBlock)]


def _deepseek_worker(rank: int, world: int, export_dir: str) -> dict:
    out = {}
    for exchange in ("per_assignment", "dedup"):
        export = dict(checkpoint_dir=f"{export_dir}/{exchange}", export_model=True)
        cfg = TrainConfig.flat(**DEEPSEEK, expert_parallel=2, expert_exchange=exchange, **export)
        session = prepare(cfg, corpus(), setup_distributed("cpu"))
        out[exchange] = (curves(run(session).history), balance_biases(session.place.model))
    return out


def test_swapped_deepseek_v3_under_expert_parallelism_is_the_single_process_model(tmp_path):
    """Its 4 groups of 2 experts map to the 2 ranks (the deduplicated exchange sends a token to
    each of its 2 groups' rank once): per-step loss, aux loss and gradient norm equal one process,
    and so does the correction bias that loss-free balancing moved from the global counts; the
    exported model (every rank's experts gathered) loads as the single-process model."""
    cfg = TrainConfig.flat(**DEEPSEEK, checkpoint_dir=str(tmp_path / "one"), export_model=True)
    session = prepare(cfg, corpus(), setup_distributed("cpu"))
    ref, ref_bias = curves(run(session).history), balance_biases(session.place.model)
    assert len(ref_bias) == 2 and all(b.abs().max() > 0 for b in ref_bias), "the bias did not train"
    want = load_export(tmp_path / "one" / "model.pt").state_dict()
    per_rank = ok_values(run_local(_deepseek_worker, 2, str(tmp_path), timeout_s=600))
    for exchange, (got, bias) in per_rank[0].items():
        assert len(got) == len(ref) == DEEPSEEK["steps"]
        for step, (g, w) in enumerate(zip(got, ref), 1):
            for key, a, b in zip(KEYS, g, w):
                assert abs(a - b) <= REL_TOL * abs(b), f"{exchange} step {step} {key}: {a!r} vs {b!r}"
        for layer, (a, b) in enumerate(zip(bias, ref_bias)):
            torch.testing.assert_close(a, b, rtol=REL_TOL, atol=1e-7, msg=f"{exchange} layer {layer} bias")
        exported = load_export(tmp_path / exchange / "model.pt").state_dict()
        assert exported.keys() == want.keys()
        for name, value in exported.items():  # rounding, through Adam, moves weights by ~1e-5 (measured);
            # another rank's experts or a wrong order would move them by their size, ~0.02
            torch.testing.assert_close(value, want[name], rtol=0, atol=1e-4, msg=f"{exchange} export {name}")
