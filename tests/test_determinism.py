""" "Bitwise reproducible, no atomics": checks that fail when a nondeterministic op enters the path.

On a CPU nothing runs nondeterministically, so rerunning alone shows little. Three checks
that bite here too:

1. ``MoELayer`` forward + backward (torch backend, every router configuration of
   ``helpers.ROUTER_CONFIGS``) under ``torch.use_deterministic_algorithms(True)``, which
   raises on ops torch knows to be nondeterministic and fills uninitialised memory with NaN
   (so a read of ``torch.empty`` garbage shows), run twice and compared bitwise.
2. Every aten op of the same forward + backward, recorded below autograd: none may add two
   sources into one destination (``index_add``, ``scatter_add``, ``index_put(...,
   accumulate=True)``, ... with repeated indices). On CUDA those sum through atomics in a
   varying order; with distinct destinations (the backward of a permutation, of a top-k
   gather) every destination receives one value and the order cannot matter.
3. The source of every Triton kernel of ``kernels/``: no ``tl.atomic_*`` call, and no call
   to a helper this check could not see into. The compiled sm_90 PTX is checked for
   ``atom.`` / ``red.`` instructions in ``test_kernels_compile.py``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap

import pytest
import torch
from extras import need
from helpers import ROUTER_CONFIGS
from torch.utils._python_dispatch import TorchDispatchMode

import causal_moe_kernels
import moe


def _has_repeats(rows_XK: torch.Tensor) -> bool:
    """True if two rows of the [X, K] integer tensor are equal."""
    return rows_XK.shape[0] > 0 and torch.unique(rows_XK, dim=0).shape[0] < rows_XK.shape[0]


def colliding_destinations(name: str, args: tuple, kwargs: dict) -> bool | None:
    """For an op that adds into its destination (index_add, scatter_add, scatter_reduce,
    index_reduce, embedding_dense_backward, or index_put / put with accumulate=True):
    whether two sources land on one destination, so that the result depends on the order of
    the additions (on CUDA, of atomics). None for any other op, and for integer destinations:
    integer addition is exact, so its order cannot change the result (counting experts'
    tokens with ``index_add`` is deterministic)."""
    if isinstance(args[0], torch.Tensor) and not (args[0].is_floating_point() or args[0].is_complex()):
        return None
    if name in ("index_add", "index_reduce"):
        return _has_repeats(args[2].reshape(-1, 1))
    if name in ("scatter_add", "scatter_reduce"):
        dim, index = args[1], args[2]
        idx_XK = index.movedim(dim, -1).reshape(-1, index.shape[dim]) if index.dim() else index.view(1, 1)
        return bool((idx_XK.sort(-1).values.diff(dim=-1) == 0).any())
    if name == "embedding_dense_backward":
        return _has_repeats(args[1].reshape(-1, 1))
    if name in ("index_put", "_index_put_impl", "put"):
        if not (kwargs.get("accumulate") or (len(args) > 3 and args[3] is True)):
            return None
        if name == "put":
            return _has_repeats(args[1].reshape(-1, 1))
        indices = [i for i in args[1] if i is not None]
        if any(i.dtype == torch.bool for i in indices):
            return False  # a mask selects each position at most once
        columns = torch.broadcast_tensors(*indices)
        return _has_repeats(torch.stack([c.reshape(-1) for c in columns], -1))
    return None


class RecordOps(TorchDispatchMode):
    """Records each aten op that runs (forward and backward), and the accumulating ones whose
    destinations collide."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.colliding: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1].rstrip("_")  # in-place variants count as their op
        self.ops.append(name)
        if colliding_destinations(name, args, kwargs):
            self.colliding.append(name)
        return func(*args, **kwargs)


def layer_run(layer: moe.MoELayer, x_BTD: torch.Tensor) -> list[torch.Tensor]:
    """Output, aux loss and every gradient (input and parameters) of one forward + backward."""
    layer.zero_grad(set_to_none=True)
    x = x_BTD.clone().requires_grad_(True)
    y, routing = layer(x, return_routing=True)
    gy = torch.linspace(-1, 1, y.numel()).view_as(y)
    ((y * gy).sum() + routing.aux_loss).backward()
    return [y.detach(), routing.aux_loss.detach(), x.grad] + [p.grad for p in layer.parameters() if p.grad is not None]


@pytest.fixture
def deterministic():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


@pytest.mark.parametrize("name,opts", ROUTER_CONFIGS)
def test_layer_bitwise_reproducible_under_deterministic_mode(name, opts, deterministic):
    torch.manual_seed(0)
    layer = moe.MoELayer(16, 24, 4, router=name, backend="torch", **opts)
    x = torch.randn(3, 9, 16)
    first, second = layer_run(layer, x), layer_run(layer, x)
    assert len(first) == len(second) > 3
    for i, (a, b) in enumerate(zip(first, second)):
        assert not a.isnan().any(), f"tensor {i} has NaN: uninitialised memory read?"
        assert torch.equal(a, b), f"tensor {i} differs between reruns: max {(a - b).abs().max():.3e}"


@pytest.mark.parametrize("name,opts", ROUTER_CONFIGS)
def test_no_op_sums_into_a_shared_destination(name, opts):
    torch.manual_seed(0)
    layer = moe.MoELayer(16, 24, 4, router=name, backend="torch", **opts)
    with RecordOps() as rec:
        layer_run(layer, torch.randn(3, 9, 16))
    assert len(rec.ops) > 50, "the recorder saw no ops"
    assert rec.colliding == [], f"ops that add several sources into one destination: {rec.colliding}"


def test_recorder_catches_colliding_accumulation():
    """The check above is not vacuous; and permutations (distinct destinations) are fine."""
    rep, perm = torch.tensor([0, 0, 1]), torch.tensor([2, 0, 1])
    with RecordOps() as rec:
        torch.zeros(3).index_add(0, rep, torch.ones(3))
        torch.zeros(3).index_add(0, perm, torch.ones(3))
        torch.zeros(3).index_put((rep,), torch.ones(3), accumulate=True)
        torch.zeros(3).index_put((perm,), torch.ones(3), accumulate=True)
        torch.zeros(3).index_put((rep,), torch.ones(3))
        torch.zeros(2, 3).scatter_add(1, torch.tensor([[0, 1], [2, 2]]), torch.ones(2, 2))
        torch.zeros(2, 3).scatter_add(1, torch.tensor([[0, 1], [2, 1]]), torch.ones(2, 2))
        torch.zeros(3, requires_grad=True)[rep].sum().backward()
    assert rec.colliding == ["index_add", "index_put", "scatter_add", "index_put"]


def triton_kernels() -> dict[str, object]:
    """Every kernel function of the ``causal_moe_kernels`` package, found through its ``Kernel`` wrappers."""
    need("triton", "triton")
    from causal_moe_kernels.launch import Kernel

    found = {}
    for info in pkgutil.iter_modules(causal_moe_kernels.__path__, "causal_moe_kernels."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if isinstance(obj, Kernel):
                found[obj.fn.__name__] = obj.fn
    return found


def atomic_calls(fn) -> list[str]:
    """``tl.atomic_*`` calls, and calls to anything but ``tl.*`` or ``range``, in fn's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr.startswith("atomic_"):
            bad.append(f"{ast.unparse(f)} (line {node.lineno})")
        elif isinstance(f, ast.Name) and f.id != "range":
            bad.append(f"call to {f.id} (line {node.lineno}): a helper this check cannot see into")
    return bad


def test_triton_kernels_have_no_atomics_in_source():
    found = triton_kernels()
    assert {"_gmm_kernel", "_wgrad_kernel", "_gather_kernel", "_combine_kernel", "_scatter_kernel"} <= set(found)
    bad = {name: calls for name, fn in found.items() if (calls := atomic_calls(fn))}
    assert bad == {}, f"atomics or opaque helpers in Triton kernels: {bad}"


def test_atomic_check_catches_an_atomic():
    def _leaky_kernel(out_ptr, v_ptr):
        tl.atomic_add(out_ptr, tl.load(v_ptr))  # noqa: F821 (never run: only parsed)

    assert atomic_calls(_leaky_kernel) == ["tl.atomic_add (line 2)"]
