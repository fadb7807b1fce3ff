"""The router features of issue 47 on several gloo processes, equal to one process.

* Expert parallelism (2 ranks, float64): an MoE layer with DeepSeek-V3-style routing (sigmoid,
  a balance bias, 2 groups mapped to the 2 ranks, a route scale), gated shared experts and all
  three balance losses gives the single-process outputs and gradients, through the
  per-assignment exchange and the rank-deduplicated one; with one group per token the
  deduplicated exchange sends one row per token each way where the other sends k.
* Data parallelism with microbatches (2 ranks x 2 microbatches, float64): the sequence and
  global balance losses and their gradients equal one process forwarding the whole batch; the
  micro-batch loss equals it with one microbatch per rank.
* The trainer under FSDP2 and expert parallelism with 2 microbatches (4 processes, slow), also
  with ``expert_exchange="dedup"``: the losses, aux losses (sequence and global) and gradient
  norms of 12 steps equal the single-process run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import TINY_RUN

from moe.global_balance import global_batch_loads
from moe.layer import MoELayer
from moe.model import MoETransformer, preset
from moe.parallel import ExpertParallel, load_full_state_dict, reduce_gradients, share_router_statistics
from moe.parallel.launch import ok_values, run_local
from moe.training import TrainConfig, train

TOL = 1e-10
E, D, F, T = 4, 8, 6, 6
DEEPSEEK = {
    "top_k": 2,
    "gate": "sigmoid",
    "num_expert_groups": 2,
    "num_limited_groups": 1,
    "route_scale": 2.5,
    "aux_loss_coef": 0.1,
    "seq_aux_loss_coef": 0.2,
    "global_aux_loss_coef": 0.3,
}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    return float((a - b).detach().abs().max()) if a.numel() else 0.0


def _count_rows(sent: list[int]):
    """Wrap dist.all_to_all_single so that the rows of every float send are added to ``sent``."""
    real = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if input.is_floating_point() and input.dim() == 2 and input.shape[1] == D:
            sent.append(input.shape[0])
        return real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    return real, counting


def _expert_parallel_worker(rank: int, world: int) -> dict[str, float]:
    group = dist.group.WORLD
    out: dict[str, float] = {}
    rows = slice(2 * rank, 2 * rank + 2)
    torch.manual_seed(2)
    x, g = torch.randn(2 * world, T, D, dtype=torch.float64), torch.randn(2 * world, T, D, dtype=torch.float64)
    for dedup in (False, True):
        torch.manual_seed(1)
        layer = dict(router="topk", shared_experts=1, shared_expert_gate=True, **DEEPSEEK)
        full = MoELayer(D, F, E, **layer).double()
        full.router.balance_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
        ep = MoELayer(D, F, E, expert_parallel=ExpertParallel(group, dedup=dedup), **layer).double()
        load_full_state_dict(ep, full.state_dict())
        share_router_statistics(ep, group)
        x_full = x.clone().requires_grad_()
        y_full, routing_full = full(x_full, return_routing=True)
        ((y_full * g).sum(-1).mean() + routing_full.aux_loss).backward()
        x_r = x[rows].clone().requires_grad_()
        sent: list[int] = []
        real, counting = _count_rows(sent)
        dist.all_to_all_single = counting
        try:
            y_r, routing_r = ep(x_r, return_routing=True)
        finally:
            dist.all_to_all_single = real
        ((y_r * g[rows]).sum(-1).mean() + routing_r.aux_loss).backward()
        reduce_gradients(ep)
        case = "dedup" if dedup else "per_assignment"
        rows_sent = torch.tensor(float(sum(sent)))  # dispatched and returned, over every rank
        dist.all_reduce(rows_sent)
        out[f"{case}/rows_sent_per_token"] = rows_sent.item() / x[..., 0].numel()
        out[f"{case}/output"] = _max_diff(y_r, y_full[rows])
        out[f"{case}/input_grad"] = _max_diff(x_r.grad, world * x_full.grad[rows])  # a mean over 1/P of the tokens
        aux = routing_r.aux_loss.detach().clone()
        dist.all_reduce(aux)
        out[f"{case}/aux_loss"] = abs(aux.item() / world - routing_full.aux_loss.item())
        start, stop = ep.local_experts
        for name, p in ep.named_parameters():
            want = dict(full.named_parameters())[name].grad
            out[f"{case}/{name}_grad"] = _max_diff(p.grad, want[start:stop] if name.startswith("experts.") else want)
        # one group of 2 experts per token, groups = ranks: every token's experts share one rank
        rank_NK = routing_r.expert.view(-1, 2) // (E // world)
        out[f"{case}/ranks_per_token"] = float(((rank_NK[:, 0] != rank_NK[:, 1]).long() + 1).max())
    return out


def _model(**options) -> MoETransformer:
    torch.manual_seed(0)
    router_options = {"top_k": 2, "z_loss_coef": 0.0, "aux_loss_coef": 0.0, "balance_rate": 0.1, **options}
    cfg = preset(
        "tiny",
        d_model=16,
        n_heads=2,
        moe_d_ff=8,
        num_experts=4,
        router="topk",
        router_options=router_options,
        shared_experts=1,
        shared_expert_gate=True,
    )
    return MoETransformer(cfg).double()


def _step(model: MoETransformer, idx_BT: torch.Tensor, microbatches: int) -> float:
    chunks = idx_BT.chunk(microbatches)
    total = 0.0
    with global_batch_loads(model, [lambda c=c: model(c) for c in chunks]):
        for c in chunks:  # the balance losses alone: the LM loss is computed in fp32
            loss = model(c).aux_loss / microbatches
            loss.backward()
            total += loss.item()
    return total


LOSSES = {
    "global": {"global_aux_loss_coef": 1.0},
    "sequence": {"seq_aux_loss_coef": 1.0},
    "micro": {"aux_loss_coef": 1.0},
}
"""Each balance loss alone, with the microbatches per rank at which it equals one process."""
MICROBATCHES = {"global": 2, "sequence": 2, "micro": 1}


def _data_parallel_worker(rank: int, world: int) -> dict[str, float]:
    torch.manual_seed(5)
    idx = torch.randint(0, 256, (4 * world, 10))
    out = {}
    for name, options in LOSSES.items():
        full = _model(**options)
        want_loss = _step(full, idx, 1)
        model = _model(**options)
        share_router_statistics(model, dist.group.WORLD)
        loss = torch.tensor(_step(model, idx[4 * rank : 4 * rank + 4], MICROBATCHES[name]), dtype=torch.float64)
        dist.all_reduce(loss)
        out[f"{name}/loss"] = abs(loss.item() / world - want_loss)
        for (n, p), (_, q) in zip(model.named_parameters(), full.named_parameters()):
            if q.grad is None:  # above the last router (final norm, head): no balance-loss gradient
                assert p.grad is None, n
                continue
            grad = p.grad.clone()
            dist.all_reduce(grad)
            out[f"{name}/{n}"] = _max_diff(grad / world, q.grad)
    return out


def _worker(rank: int, world: int) -> tuple[dict[str, float], dict[str, float]]:
    return _expert_parallel_worker(rank, world), _data_parallel_worker(rank, world)


def test_expert_and_data_parallel_with_every_feature_equal_one_process():
    """Both checks in one spawn of 2 processes (starting them is most of the time)."""
    for rank, (ep, dp) in enumerate(ok_values(run_local(_worker, 2))):
        for case in ("per_assignment", "dedup"):
            checked = [k for k in ep if k.startswith(case) and not k.endswith("per_token")]
            assert len(checked) == 11, checked  # output, input grad, aux, every parameter's gradient
            for key in checked:
                assert ep[key] <= TOL, f"rank {rank} expert parallel {key}: max diff {ep[key]:.3e}"
        assert ep["per_assignment/rows_sent_per_token"] == 4.0  # k = 2 rows per token, out and back
        assert ep["dedup/rows_sent_per_token"] == 2.0  # one row out and back: its experts share a rank
        assert ep["dedup/ranks_per_token"] == 1.0
        assert len(dp) > 3 * 15
        worst = max(dp, key=dp.get)
        assert dp[worst] <= TOL, f"rank {rank} data parallel {worst}: max diff {dp[worst]:.3e}"


# -- the trainer ---------------------------------------------------------------------------------
LAYOUTS = {
    "dp_shard2_ep2": (1, 2, "per_assignment"),
    "ep4": (1, 4, "per_assignment"),
    "dp_replicate2_ep2": (2, 2, "per_assignment"),
    "dp_shard2_ep2_dedup": (1, 2, "dedup"),  # the groups map to the 2 ranks: one row per token each way
}
FEATURES = dict(
    router="topk",
    # the micro-batch loss depends on how a step is cut; the sequence and global ones do not
    router_options={**DEEPSEEK, "aux_loss_coef": 0.0, "balance_rate": 1e-3},
    model={"shared_experts": 1, "shared_expert_gate": True},
    microbatches=2,
)
KEYS = ("loss", "aux_loss", "grad_norm")


def _curves(history: list[dict]) -> list[tuple[float, ...]]:
    return [tuple(r[k] for k in KEYS) for r in history]


def _trainer_worker(rank: int, world: int) -> dict:
    curves = {}
    for name, (r, p, exchange) in LAYOUTS.items():
        res = train(
            TrainConfig.flat(dp_replicate=r, expert_parallel=p, expert_exchange=exchange, **FEATURES, **TINY_RUN)
        )
        paths = {m.expert_parallel.dedup for m in res.model.modules() if isinstance(m, MoELayer)}
        assert paths == {exchange == "dedup"}, f"{name}: the layers' exchanges are dedup={paths}"
        curves[name] = _curves(res.history)
    return curves


@pytest.mark.slow
def test_trainer_with_every_feature_matches_single_process_under_fsdp2_and_expert_parallelism():
    ref = _curves(train(TrainConfig.flat(**FEATURES, **TINY_RUN)).history)
    for name, curves in ok_values(run_local(_trainer_worker, 4, timeout_s=900))[0].items():
        assert len(curves) == len(ref) == 12
        for i, key in enumerate(KEYS):
            rel = max(abs(a[i] - b[i]) / abs(b[i]) for a, b in zip(curves, ref))
            assert rel <= 1e-4, f"{name}: {key} differs from one process by {rel:.2e} (relative)"
