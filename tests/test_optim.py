"""The loop's AdamW (``moe.training.optim.BlockedAdamW``) against torch's own: the same weights,
states and state dict, bit for bit, where it steps block by block on CPU, and torch's own path
elsewhere."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe.training import optim
from moe.training.optim import BlockedAdamW, OptimizerConfig, make_optimizer

# element counts around the block: below it, exactly one, one and a bit (a short last block), several
SHAPES = [(3, 5), (7,), (BlockedAdamW.BLOCK,), (3, BlockedAdamW.BLOCK // 2 + 37), (4, 257, 513)]


def params_and_grads(seed: int) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def run(opt_cls, steps: int = 4, **options) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    """``steps`` AdamW steps (two groups, decayed and not, the lr changed every step as the loop's
    schedule does) on fixed parameters and per-step gradients."""
    params = params_and_grads(0)
    groups = [{"params": params[::2], "weight_decay": 0.1}, {"params": params[1::2], "weight_decay": 0.0}]
    opt = opt_cls(groups, lr=1e-2, betas=(0.9, 0.99), **options)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = 1e-2 / (step + 1)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * (step + 1)
        if step == 1:
            params[1].grad = None  # a parameter without a gradient this step is skipped
        opt.step()
    return params, opt


def assert_same(a, b) -> None:
    (pa, oa), (pb, ob) = a, b
    for x, y in zip(pa, pb):
        assert torch.equal(x, y), f"weights differ: max {(x - y).abs().max():.3g}"
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa["state"][k][name], sb["state"][k][name]), (k, name)


def test_blocked_adamw_is_torchs_for_loop_adamw_bitwise(monkeypatch):
    reference = run(torch.optim.AdamW)  # on CPU: its for-loop implementation
    sizes = []
    adam = optim.adam
    monkeypatch.setattr(optim, "adam", lambda params, *a, **k: sizes.append(params) or adam(params, *a, **k))
    blocked = run(BlockedAdamW)
    assert_same(blocked, reference)
    # it did run block by block: no piece larger than a block, the large tensors cut
    assert sizes and max(p.numel() for call in sizes for p in call) <= BlockedAdamW.BLOCK
    assert len(sizes[0]) > len(SHAPES[::2])


@pytest.mark.parametrize("options", [{"foreach": True}, {"amsgrad": True}, {"fused": True}])
def test_other_adamw_options_are_torchs(options):
    assert_same(run(BlockedAdamW, **options), run(torch.optim.AdamW, **options))


def test_hooks_and_closure_as_torchs():
    params = params_and_grads(0)
    opt = BlockedAdamW(params, lr=1e-3)
    seen = []
    opt.register_step_pre_hook(lambda *_: seen.append("pre"))
    opt.register_step_post_hook(lambda *_: seen.append("post"))
    for p in params:
        p.grad = torch.ones_like(p)
    assert opt.step(lambda: torch.tensor(2.0)) == 2.0
    assert seen == ["pre", "post"]


def test_make_optimizer_groups():
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    opt = make_optimizer(model, OptimizerConfig(weight_decay=0.05))
    assert isinstance(opt, BlockedAdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    assert [len(g["params"]) for g in opt.param_groups] == [1, 3]


def test_non_contiguous_state_takes_torchs_path():
    """States loaded from elsewhere may be strided: then torch's own step, the same numbers."""
    a, b = params_and_grads(0)[-1:], params_and_grads(0)[-1:]
    oa, ob = BlockedAdamW(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2)
    for p, o in ((a[0], oa), (b[0], ob)):
        p.grad = torch.ones_like(p)

        def strided() -> torch.Tensor:
            return torch.zeros(p.shape[::-1]).transpose(0, -1)  # p's shape, not contiguous

        o.state[p] = {"step": torch.tensor(0.0), "exp_avg": strided(), "exp_avg_sq": strided()}
        o.step()
    assert torch.equal(a[0], b[0])
