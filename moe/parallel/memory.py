"""This process's memory as a training run reports it: the peak so far and the current size.

On CUDA the caching allocator's figures for the device (bytes allocated to tensors); on CPU
the resident set size (``VmHWM`` / ``statm`` from ``/proc``), which also counts what the
interpreter, torch and glibc hold: glibc keeps freed memory for reuse, so a CPU peak is an
upper bound on the tensors' (``experiments/bench_memory.py`` says how far).
"""

from __future__ import annotations

import ctypes
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
        ctypes.CDLL("libc.so.6").malloc_trim(0)
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
