"""Shared test helpers: routers with hand-set logits, a naive per-assignment reference, and the
settings of the short training runs the trainer tests compare."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import moe
from moe.routers import ROUTER_TABLE, router_configs

ROOT = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = str(ROOT / "experiments" / "train.py")
SOURCE_PATH = os.pathsep.join([str(ROOT), str(ROOT / "kernels")])
"""This checkout's packages on PYTHONPATH: moe/ at the root, causal_moe_kernels under kernels/."""
SUBPROCESS_ENV = {**os.environ, "PYTHONPATH": SOURCE_PATH, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
"""The environment of a script run as a user would: this checkout importable, no wandb, one thread."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_on_two_processes(args: list[str], timeout_s: float) -> list[tuple[str, str]]:
    """``experiments/train.py ARGS`` on two gloo processes (RANK / WORLD_SIZE set as torchrun
    sets them); each rank's (stdout, stderr), after asserting that both exited 0."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, TRAIN_SCRIPT, *args],
            env={
                **SUBPROCESS_ENV,
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout_s)
        assert p.returncode == 0, err[-3000:]
        outs.append((out, err))
    return outs


def identity_router(name: str, num_experts: int, **options) -> moe.Router:
    """A router whose gate is the identity, so the input features *are* the logits. A null-expert
    gate reads one feature per row, halved and of alternating sign: like the identity, exact
    however the matmul sums, where a random gate's last bit depends on how many rows the CPU's
    kernel is given (a decoded chunk of 3 rows against the full 69)."""
    r = moe.build_router(name, d_model=num_experts, num_experts=num_experts, **options).double()
    with torch.no_grad():
        r.gate.weight.copy_(torch.eye(num_experts))
        if getattr(r, "null_experts", 0):
            w, m = r.null_gate.weight, torch.arange(r.null_experts)
            w.zero_()[m, m % num_experts] = torch.where(m % 2 == 0, 0.5, -0.5).to(w.dtype)
    return r


def small_lm(
    router: str,
    options: dict,
    dtype: torch.dtype = torch.float32,
    vocab_size: int = 32,
    max_seq_len: int = 32,
    **config,
):
    """A two-block MoETransformer (d 16, 4 experts of width 16) routing with ``router``, in
    ``dtype``; ``config``: other ModelConfig fields (shared experts, ...)."""
    from moe.model import ModelConfig, MoETransformer

    cfg = ModelConfig(
        vocab_size=vocab_size,
        d_model=16,
        n_layers=2,
        n_heads=2,
        moe_d_ff=16,
        num_experts=4,
        router=router,
        router_options=options,
        max_seq_len=max_seq_len,
        **config,
    )
    return MoETransformer(cfg, init_seed=1).to(dtype)


def assignments(routing: moe.Routing) -> list[tuple[int, int]]:
    """The kept (token, expert) pairs of a routing, sorted."""
    return sorted(zip(routing.token.tolist(), routing.expert.tolist()))


def routed_weights(routing: moe.Routing) -> dict[tuple[int, int], float]:
    """{(token, expert): combine weight} of a routing's kept assignments."""
    return {(int(t), int(e)): float(w) for t, e, w in zip(routing.token, routing.expert, routing.weight.detach())}


def hand_logits(*rows, batch: int = 1) -> torch.Tensor:
    """float64 [batch, T, E] from rows of E logits (for an :func:`identity_router`)."""
    x = torch.tensor(rows, dtype=torch.float64)
    return x.view(batch, -1, x.shape[-1])


def naive_moe(layer: moe.MoELayer, x_BTD: torch.Tensor, routing: moe.Routing) -> torch.Tensor:
    """y[n] += w * SwiGLU_e(x[n]) for every kept assignment, one at a time."""
    b, t, d = x_BTD.shape
    x_ND = x_BTD.reshape(b * t, d)
    ex = layer.experts
    rows = [torch.zeros(d, dtype=x_BTD.dtype) for _ in range(b * t)]
    for a in range(routing.num_assignments):
        n, e, w = int(routing.token[a]), int(routing.expert[a]), routing.weight[a]
        h = F.silu(x_ND[n] @ ex.w_gate[e]) * (x_ND[n] @ ex.w_up[e])
        rows[n] = rows[n] + w * (h @ ex.w_down[e])
    return torch.stack(rows).view(b, t, d)


DEEPSEEK_V3_STYLE = dict(ROUTER_TABLE["topk_deepseek_v3"].options)
"""Top-k routed as DeepSeek-V3 routes (sigmoid, balance bias, 2 groups of which a token keeps
1, a route scale) with its sequence and global balance losses, for E = 4 experts."""

ROUTER_CONFIGS: list[tuple[str, dict]] = router_configs("tests")
"""(router name, options) of every row of ``moe.routers.ROUTER_TABLE`` used by "tests"."""


def tiny_run_flags(steps: int = 12) -> list[str]:
    """Command-line flags of the short tiny-preset run that the multi-process trainer tests
    compare with one process (12 steps of 8 x 64 tokens, 2 evaluation windows, no logging)."""
    return [
        *("--preset", "tiny", "--steps", str(steps), "--batch-size", "8", "--seq-len", "64"),
        *("--max-bytes", "200000", "--eval-windows", "2", "--causal-stride", "64", "--log-every", "0"),
        *("--no-progress", "--wandb-mode", "disabled"),
    ]


TINY_RUN = dict(
    preset="tiny",
    steps=12,
    batch_size=8,
    seq_len=64,
    max_bytes=200_000,
    eval_windows=2,
    causal_stride=64,
    log_every=0,
    progress=False,
    wandb_mode="disabled",
)
"""TrainConfig.flat keywords of the same short tiny-preset run as :func:`tiny_run_flags`."""


SMALL_RUN = dict(
    seq_len=32,
    batch_size=8,
    max_bytes=200_000,
    eval_windows=4,
    eval_batch_size=4,
    causal_stride=8,
    warmup_steps=2,
    log_every=0,
    progress=False,
    model={"d_model": 32, "moe_d_ff": 64},
)
"""TrainConfig.flat keywords of the small in-process runs (a d=32 tiny model, 8 x 32 tokens)."""


HF_RUN = dict(
    lr=1e-2,
    seq_len=32,
    batch_size=8,
    eval_windows=2,
    eval_batch_size=2,
    causal_stride=16,
    warmup_steps=2,
    log_every=0,
    progress=False,
)
"""TrainConfig.flat keywords of the short runs of a tiny ``--hf-model`` (8 x 32 tokens, lr 1e-2)."""


def assert_replay_is_the_recorded_forward(model, idx_BT: torch.Tensor, targets_BT: torch.Tensor) -> moe.RoutingRecord:
    """Record a forward of ``model`` and its gradients, replay the record: the same logits, aux
    loss and gradients, bit for bit. Returns the record."""
    params = list(model.parameters())
    with moe.record_routing(model) as record:
        out = model(idx_BT, targets_BT)
        grads = torch.autograd.grad(out.loss + out.aux_loss, params)
    with moe.replay_routing(model, record):
        again = model(idx_BT, targets_BT)
        grads_again = torch.autograd.grad(again.loss + again.aux_loss, params)
    assert torch.equal(out.logits, again.logits) and torch.equal(out.aux_loss, again.aux_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_again))
    return record


def assert_cache_decoding_is_the_full_forward(model, idx_BT: torch.Tensor, tol: float = 1e-5) -> None:
    """``model`` (eval mode) fed ``idx_BT`` one token at a time through its KV cache gives the
    logits of one full forward (fp32: within ``tol``, the summation-order noise of attention
    over a cache against the full causal mask)."""
    b, t = idx_BT.shape
    with torch.no_grad():
        full = model(idx_BT).logits
        cache = model.init_cache(b)
        steps = torch.cat([model(idx_BT[:, i : i + 1], cache=cache).logits for i in range(t)], 1)
    assert (steps - full).abs().max() < tol, (
        f"max {(steps - full).abs().max():.3g}, mean {(steps - full).abs().mean():.3g}"
    )


def study_row(
    router: str, seed: int, causal: float, tf: float | None = None, corpus: str = "c", size: str = "s", dead: int = 0
) -> dict:
    """One stored row of the router study (the fields ``experiments/study_stats.py`` reads), with
    the given losses (``tf``: the teacher-forced loss, default the causal one)."""
    tf = causal if tf is None else tf
    return {
        "corpus": corpus,
        "size": size,
        "router": router,
        "seed": seed,
        "teacher_forced_loss": tf,
        "causal_loss": causal,
        "leakage_gap": causal - tf,
        "max_vio": 0.1,
        "active_experts_mean": 2.0,
        "tokens_per_s": 1000.0,
        "active_params": 1000,
        "dead_experts": dead,
        "config": {"data": {"batch_size": 12}, "eval": {"eval_batch_size": 64}},
    }
