"""How the Triton kernels of this package are launched: compiled on CUDA, interpreted elsewhere.

Triton decides between compiling and interpreting when ``@triton.jit`` runs (it reads
``TRITON_INTERPRET`` at decoration time). Here the choice is made per launch instead: a
:class:`Kernel` wraps the plain Python function and builds the compiled form for CUDA
tensors and the interpreted form (``TRITON_INTERPRET=1`` semantics) for CPU tensors, each on
first use. So the same process can run the kernels on a GPU and, in tests, on the CPU, no
matter which modules imported triton first or what the environment says.

Facts about the interpreter (triton 3.9, torch 2.13 CPU) that the kernels respect:
``tl.dot`` on bf16 tiles returns wrong values (kernels take a ``DOT_FP32`` flag and cast tiles
to fp32 when interpreting); a multi-config ``@triton.autotune`` fails without a GPU (block
sizes are chosen by :func:`matmul_blocks`); bf16 atomics fail (no kernel uses atomics);
arrays of pointers are unsupported. Kernels call no ``@triton.jit`` function of their own;
the ``tl.sum`` / ``tl.cumsum`` / ``tl.sigmoid`` they use are ``@triton.jit`` functions of
triton's standard library, compiled-form objects when triton was imported without
``TRITON_INTERPRET``: while an interpreted kernel runs, :func:`_nested_jit_interpreted`
makes such calls run their Python body in the interpreter (what ``TRITON_INTERPRET=1`` at
import would have done). Do not set ``TRITON_INTERPRET=1`` in a process that launches on CUDA.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


class Kernel:
    """A Triton kernel runnable on CUDA (compiled) and on CPU (interpreted).

    ``Kernel(fn)[grid, device](*args)``: ``fn`` is an undecorated kernel function written for
    ``@triton.jit``; ``device`` picks the compiled (``cuda``) or interpreted (anything else) form.
    """

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._forms: dict[bool, object] = {}

    def form(self, interpret: bool):
        if interpret not in self._forms:
            if interpret:
                from triton.runtime.interpreter import InterpretedFunction

                self._forms[interpret] = InterpretedFunction(self.fn)
            else:
                from triton.runtime.jit import JITFunction

                self._forms[interpret] = JITFunction(self.fn)
        return self._forms[interpret]

    def __getitem__(self, grid_and_device: tuple[tuple[int, ...], torch.device]):
        grid, device = grid_and_device
        if not interpreting(device):
            return self.form(False)[grid]
        launch = self.form(True)[grid]

        def run_interpreted(*args, **kwargs):
            with _nested_jit_interpreted():
                return launch(*args, **kwargs)

        return run_interpreted


_INTERPRETED_HELPERS: dict[int, object] = {}


@contextlib.contextmanager
def _nested_jit_interpreted():
    """Let compiled-form ``@triton.jit`` helpers (``tl.sum``...) be called from interpreted code.

    ``triton.language.core`` is patched for the interpreter once, around the whole launch
    (the launch itself patches ``triton.language`` inside, and undoes it first), and each
    helper runs its cached rewritten Python body, as ``InterpretedFunction`` would.
    """
    import types

    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    def call_interpreted(self, *args, **kwargs):
        key = id(self.fn)
        if key not in _INTERPRETED_HELPERS:
            _INTERPRETED_HELPERS[key] = interpreter.InterpretedFunction(self.fn).rewrite()
        return _INTERPRETED_HELPERS[key](*args, **kwargs)

    scope = interpreter._patch_lang(types.SimpleNamespace(__globals__={"core": tl.core}))
    original = JITFunction.__call__
    JITFunction.__call__ = call_interpreted
    try:
        yield
    finally:
        JITFunction.__call__ = original
        if hasattr(scope, "restore"):
            scope.restore()


TRITON_MISSING = (
    "the Triton kernels need triton, which is not installed: CUDA builds of torch for Linux bring it, "
    "else pip install 'causal-moe-routing[triton]' (backend='torch' or 'auto' run without it)"
)
"""What a request for the kernels says on a machine without triton (the ``[triton]`` extra)."""


def triton_installed() -> bool:
    """Whether triton can be imported here (it is an optional requirement: the ``[triton]`` extra)."""
    return importlib.util.find_spec("triton") is not None


def interpreting(device: torch.device) -> bool:
    """True when kernels on ``device`` run in the Triton interpreter (everything but CUDA)."""
    return device.type != "cuda"


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class MatmulBlocks:
    """Tile sizes of the grouped matmuls: BM rows, BN output columns, BK reduction depth."""

    bm: int
    bn: int
    bk: int
    num_warps: int
    num_stages: int


def matmul_blocks(
    device: torch.device,
    dtype: torch.dtype,
    n_out: int,
    k_red: int,
    rows_per_expert: float = 1e9,
    two_acc: bool = False,
    two_operands: bool = False,
) -> MatmulBlocks:
    """Heuristic tile sizes (autotuning needs a GPU and is not used, so CPU and GPU agree).

    16-bit on CUDA: 128x128x64 tiles, 8 warps, 3 stages (Hopper wgmma, cp.async pipelining,
    96 KiB of shared memory); 64-row tiles when experts average under 128 rows (decode);
    half-width tiles with two accumulators (gate and up together) and half-depth with two
    operand pairs (the DUAL input gradient), so registers and shared memory stay the same.
    fp32 on CUDA: 64x64x32. The interpreter takes 64-row, <= 64-column, <= 32-deep tiles (its
    cost grows with the number of programs and loop steps, hardly with tile size; 32-deep
    keeps several reduction steps in play at test widths).
    """
    if interpreting(device):
        return MatmulBlocks(64, min(64, max(16, next_pow2(n_out))), min(32, max(16, next_pow2(k_red))), 4, 1)
    if dtype == torch.float32:
        return MatmulBlocks(64, 64, 32, 4, 3)
    bm = 128 if rows_per_expert >= 128 else 64
    bn = 128 if n_out >= 128 else 64
    bk = 64 if k_red >= 64 else 32
    if two_acc:
        bn = 64
    if two_operands:
        bk = 32
    return MatmulBlocks(bm, bn, bk, 8 if bm * bn >= 128 * 128 else 4, 3)


def check_same_device(*tensors: Tensor) -> torch.device:
    dev = tensors[0].device
    for t in tensors[1:]:
        if t.device != dev:
            raise ValueError(f"all tensors must be on one device, got {dev} and {t.device}")
    return dev
