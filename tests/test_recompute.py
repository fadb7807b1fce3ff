"""Activation checkpointing per block: the same loss, gradients and router state as without it
(1e-6 relative; measured: bitwise); ``full`` keeps fewer bytes for the backward than ``none``
and reruns the forward's matrix products there, ``selective`` keeps those products (the
backward runs no more of them than without checkpointing)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe.model import MoETransformer, preset
from moe.parallel.compile import compile_blocks
from moe.parallel.recompute import apply_activation_checkpointing

ROUTERS = [("topk", {"balance_rate": 0.01}), ("ec_threshold", {}), ("capacity", {"capacity_factor": 1.0})]


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def step(mode: str, router: str, options: dict, compiled: bool = False):
    """Loss, every gradient and every buffer after one forward + backward, the bytes the
    autograd graph kept for the backward and the matrix products the backward ran
    (``compiled``: each block's forward compiled first, traced by AOTAutograd and run eagerly;
    nothing counted then: a forward under saved-tensor hooks, or a recomputation under a
    dispatch mode, is compiled differently from the other, which the checkpoint rejects)."""
    model = MoETransformer(preset("tiny", n_layers=3, router=router, router_options=options), init_seed=7)
    if compiled:
        torch._dynamo.reset()
        compile_blocks(model.blocks, backend="aot_eager")
    apply_activation_checkpointing(model.blocks, mode)
    idx = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(3))
    kept = []

    def pack(t):
        kept.append(t.numel() * t.element_size())
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with contextlib.nullcontext() if compiled else hooks:
        out = model(idx[:, :-1], idx[:, 1:])
        loss = out.loss + out.aux_loss
    matmuls = CountMatmuls()
    with contextlib.nullcontext() if compiled else matmuls:
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, dict(model.named_buffers()), (sum(kept), matmuls.count)


@pytest.mark.parametrize("router,options", ROUTERS, ids=[r for r, _ in ROUTERS])
def test_checkpointed_blocks_give_the_same_loss_gradients_and_router_state(router, options):
    ref_loss, ref_grads, ref_buffers, (ref_bytes, ref_matmuls) = step("none", router, options)
    kept = {}
    for mode in ("full", "selective"):
        loss, grads, buffers, kept[mode] = step(mode, router, options)
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), f"{mode}: loss {loss} vs {ref_loss}"
        for name, g in ref_grads.items():
            d = (grads[name] - g).abs()
            assert d.max() <= 1e-6 * g.abs().max(), f"{mode} grad {name}: max {d.max():.3e} mean {d.mean():.3e}"
        for name, b in ref_buffers.items():
            assert torch.equal(buffers[name], b), f"{mode}: buffer {name} differs (recomputation counted twice?)"
    assert kept["full"][0] < ref_bytes / 4, f"bytes kept: {kept} vs none {ref_bytes}"
    assert kept["selective"][1] == ref_matmuls < kept["full"][1], f"backward matmuls {kept} vs none {ref_matmuls}"


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="one of none, full, selective, got 'some'"):
        apply_activation_checkpointing([], "some")


def test_compiling_a_checkpointed_block_is_refused():
    model = MoETransformer(preset("tiny"), init_seed=0)
    apply_activation_checkpointing(model.blocks, "full")
    with pytest.raises(ValueError, match="compile a block before checkpointing it"):
        compile_blocks(model.blocks)


@pytest.mark.parametrize("router,options", ROUTERS[:2], ids=[r for r, _ in ROUTERS[:2]])
def test_full_checkpointing_of_compiled_blocks_counts_router_state_once(router, options):
    """Compiled, then checkpointed: the eager checkpoint reruns the compiled forward and
    restores the buffers, so the routers' load statistics count the forward once (traced
    inside the graph they counted it twice) and loss and gradients equal the eager
    unchecked run (1e-5: the traced graph may reorder fp32 arithmetic)."""
    ref_loss, ref_grads, ref_buffers, _ = step("none", router, options)
    loss, grads, buffers, _ = step("full", router, options, compiled=True)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), f"loss {loss} vs {ref_loss}"
    for name, g in ref_grads.items():
        d = (grads[name] - g).abs()
        assert d.max() <= 1e-5 * g.abs().max(), f"grad {name}: max {d.max():.3e} mean {d.mean():.3e}"
    for name, b in ref_buffers.items():
        assert torch.allclose(buffers[name], b, rtol=1e-5, atol=1e-7), f"buffer {name}: {buffers[name]} vs {b}"


def test_selective_checkpointing_of_compiled_blocks_is_refused():
    model = MoETransformer(preset("tiny"), init_seed=0)
    compile_blocks(model.blocks)
    with pytest.raises(ValueError, match="use activation_checkpointing full with compile"):
        apply_activation_checkpointing(model.blocks, "selective")


class CountOp(TorchDispatchMode):
    def __init__(self, op):
        super().__init__()
        self.op, self.count = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is self.op
        return func(*args, **(kwargs or {}))


def test_selective_keeps_the_grouped_mm_operator_and_full_reruns_it():
    """backend="grouped_mm": the experts' products are one operator's outputs; ``selective`` keeps
    them (the backward reruns it in no block), ``full`` reruns it once per block; same gradients."""
    from causal_moe_kernels.torch_grouped import GROUPED_FFN_OP

    results = {}
    for mode in ("none", "full", "selective"):
        cfg = preset("tiny", n_layers=3, router="topk", backend="grouped_mm")
        model = MoETransformer(cfg, init_seed=7)
        apply_activation_checkpointing(model.blocks, mode)
        idx = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(3))
        out = model(idx[:, :-1], idx[:, 1:])
        with CountOp(GROUPED_FFN_OP) as reruns:
            (out.loss + out.aux_loss).backward()
        results[mode] = (reruns.count, {n: p.grad for n, p in model.named_parameters()})
    assert (results["none"][0], results["full"][0], results["selective"][0]) == (0, 3, 0), results
    for mode in ("full", "selective"):
        for name, g in results["none"][1].items():
            d = (results[mode][1][name] - g).abs()
            assert d.max() <= 1e-6 * g.abs().max(), f"{mode} grad {name}: max {d.max():.3e} mean {d.mean():.3e}"
