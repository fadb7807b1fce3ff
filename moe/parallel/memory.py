"""This process's memory as a training run reports it: the peak so far and the current size.

On CUDA the caching allocator's figures for the device (bytes allocated to tensors); on CPU
the resident set size (``VmHWM`` / ``statm`` from ``/proc``), which also counts what the
interpreter, torch and glibc hold: glibc keeps freed memory for reuse, so a CPU peak is an
upper bound on the tensors' (``experiments/bench_memory.py`` says how far).

Under FSDP2 on CPU the freed all-gather and reduce-scatter buffers are what glibc keeps: its
dynamic mmap threshold grows to the largest block freed (up to 32 MiB), after which those
buffers come from the heap and stay resident. :func:`limit_cpu_malloc` fixes the threshold
(1 MiB in the trainer), so every larger tensor is its own mapping, returned when freed, and a
CPU peak follows the tensors (docs/scaling.md has the measurement). The price is speed: every
step's gradients and large temporaries are fresh mappings whose pages are faulted in and zeroed
again; ``keep_freed`` (the trainer's ``cpu_malloc_keep``) keeps them instead
(docs/benchmarks.md has that measurement).
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource

import torch
import torch.distributed as dist


def peak_bytes(device: torch.device) -> int:
    """The peak since the process started or since :func:`reset_peak`."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) * 1024
    except OSError:  # no /proc: the lifetime peak, in KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak(device: torch.device) -> None:
    """Start a new peak from the current size (on CPU after handing glibc's free memory back)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        libc = glibc()
        if libc is not None:
            libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak resident set size
            f.write("5")


def current_bytes(device: torch.device) -> int:
    """What the process holds now."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def largest_peak_mib(device: torch.device, group=None) -> float:
    """The largest :func:`peak_bytes` over the ranks of ``group`` (a collective when a process
    group is initialised), in MiB."""
    peak = torch.tensor(float(peak_bytes(device)) / 2**20, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    return float(peak)


MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"
"""glibc reads this at startup; when it is set the user chose a threshold and it is kept."""
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
"""mallopt's parameter numbers (glibc's malloc.h)."""
KEEP_FREED = ((M_MMAP_THRESHOLD, 64 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20))
"""What :func:`limit_cpu_malloc` sets to keep freed memory: blocks below 64 MiB from the heap,
which is not trimmed below 1 GiB free and grows 64 MiB at a time (address space, not pages)."""


def glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (Linux), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL("libc.so.6")


def limit_cpu_malloc(device: torch.device, threshold_kib: int, keep_freed: bool = False) -> str | None:
    """On CPU, fix glibc's mmap threshold at ``threshold_kib`` KiB (``mallopt``), unless it is 0
    or $MALLOC_MMAP_THRESHOLD_ is set (the user's choice wins). ``keep_freed`` instead keeps
    freed memory in the process for reuse (:data:`KEEP_FREED`): a step's gradients and
    temporaries then reuse pages already mapped instead of faulting fresh ones in, and the
    resident set counts what the allocator keeps. A no-op on CUDA; elsewhere than glibc a no-op
    too, returned as the line to say (else None)."""
    if device.type != "cpu" or MMAP_THRESHOLD_ENV in os.environ or (threshold_kib == 0 and not keep_freed):
        return None
    libc = glibc()
    if libc is None:
        return (
            f"malloc is not glibc's ({platform.system()}): its mmap threshold is left as it is, so "
            "peak_memory_mib also counts freed memory the allocator keeps"
        )
    settings = KEEP_FREED if keep_freed else ((M_MMAP_THRESHOLD, threshold_kib * 1024),)
    if not all(libc.mallopt(param, value) == 1 for param, value in settings):
        return f"glibc refused the malloc settings {settings}: malloc is left as it is"
    return None
