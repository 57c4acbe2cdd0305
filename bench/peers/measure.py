"""Timing one peer's steps and the memory its optimizer adds. The definitions are repeated in the report
(report.py, DEFINITIONS)."""
import ctypes
import ctypes.util
import gc
import os
import statistics
import time
from dataclasses import dataclass

import torch

from .counts import activities

try:
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _LIBC.malloc_trim
except (OSError, AttributeError):  # not glibc
    _LIBC = None


@dataclass
class Series:
    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values):
        return cls(statistics.median(values), min(values), max(values))


def release(device):
    """Frees what the last peer left (its tensors must be unreferenced by now)."""
    gc.collect()
    if device.type == "cpu" and _LIBC is not None:
        _LIBC.malloc_trim(0)  # glibc keeps freed pages: give them back so the next RSS delta sees new ones
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def warm_up_device(device):
    """One-time costs that must not land on the first peer's memory or time: torch's cuBLAS/cuBLASLt
    handles and workspaces (kept by torch's allocator), and the profiler's CUPTI set-up."""
    if device.type != "cuda":
        return
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.ones(256, 256, device=device, dtype=dtype)
        torch.addmm(a, a, a)
        with torch.profiler.profile(activities=activities(device)):
            (a @ a).sum().item()
    del a
    release(device)


def run_steps(step, n, device, before=None):
    """n steps; returns (event_ms, wall_ms) per step. On CUDA the device is idle before each step, events
    bracket opt.step() on the current stream and the wall clock runs until the device has finished it;
    on the CPU both are the wall clock. `before` runs outside the timed region (restoring gradients)."""
    events, walls = [], []
    cuda = device.type == "cuda"
    for _ in range(n):
        if before is not None:
            before()
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            step()
            end.record()
            torch.cuda.synchronize(device)
            walls.append((time.perf_counter() - t0) * 1e3)
            events.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            walls.append((time.perf_counter() - t0) * 1e3)
    return (events if cuda else walls), walls


def _rss_bytes():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class MemoryProbe:
    """Memory the optimizer adds on top of the model's parameters and gradients (which exist before
    start()). CUDA: torch_peak = max_memory_allocated - memory_allocated at start (torch's allocator);
    outside = drop in cudaMemGetInfo free memory - growth of torch's reserved memory (cudaMalloc outside
    torch: the fast CUDA backend's buffers, cuBLASLt workspaces, lazily loaded kernels); extra = torch_peak
    + outside. Adding the raw free-memory drop instead would count torch's allocations twice. CPU: extra =
    growth of the resident set (held at the end, not a peak), torch_peak and outside n/a."""

    def __init__(self, device):
        self.device = device

    def start(self):
        release(self.device)
        if self.device.type == "cuda":
            self.alloc0 = torch.cuda.memory_allocated(self.device)
            self.reserved0 = torch.cuda.memory_reserved(self.device)
            self.free0 = torch.cuda.mem_get_info(self.device)[0]
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.rss0 = _rss_bytes()

    def stop(self):
        mib = 1 << 20
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch_peak = torch.cuda.max_memory_allocated(self.device) - self.alloc0
            reserved_growth = torch.cuda.memory_reserved(self.device) - self.reserved0
            outside = (self.free0 - torch.cuda.mem_get_info(self.device)[0]) - reserved_growth
            return dict(torch_peak_mib=torch_peak / mib, outside_mib=outside / mib,
                        extra_mib=(torch_peak + outside) / mib)
        rss = _rss_bytes()
        extra = None if rss is None or self.rss0 is None else (rss - self.rss0) / mib
        return dict(torch_peak_mib=None, outside_mib=None, extra_mib=extra)
