"""What one step dispatches, launches and waits for, counted with torch.profiler (CPU + CUDA activities).
The definitions are repeated in the report (report.py, DEFINITIONS)."""
import bisect
import re
import warnings
from collections import Counter, defaultdict
from typing import NamedTuple

import torch

MARK = "gpu_peers.step"  # the record_function range around each profiled opt.step()
KEYS = ("kernels", "memcpy", "memset", "d2h", "launch_api", "syncs", "aten_top", "aten_all")
DEVICE_KEYS = KEYS[:6]   # meaningless without CUDA activities

# CUDA runtime / driver API calls that launch device work (a graph launch counts once).
LAUNCH_APIS = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel",
               "cudaLaunchCooperativeKernelMultiDevice", "cuLaunchKernel", "cuLaunchKernelEx",
               "cuLaunchCooperativeKernel", "cudaGraphLaunch", "cuGraphLaunch"}
# Calls after which the host has waited for the device: explicit synchronisation and synchronous copies.
SYNC_APIS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
             "cuCtxSynchronize", "cuEventSynchronize", "cudaMemcpy", "cudaMemcpy2D", "cuMemcpy", "cuMemcpyDtoH",
             "cuMemcpyHtoD", "cuMemcpyDtoD"}
# torch hides these from its own tables (autograd/profiler_util.py, _filter_name): metadata, not work.
HIDDEN_ATEN = {"aten::is_leaf", "aten::output_nr", "aten::_version"}


class Ev(NamedTuple):
    """One profiler event: name, on_device (a CUDA activity), thread, start and end in ns, annotation (a
    record_function range or its GPU mirror)."""
    name: str
    on_device: bool
    thread: int
    start: int
    end: int
    annotation: bool


def activities(device):
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def profile_steps(step, n, device):
    """Per-step counts over n profiled steps (count_events); device counts only on CUDA."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events")  # torch 2.11: one cycle is all we use
        with torch.profiler.profile(activities=activities(device)) as prof:
            for _ in range(n):
                with torch.profiler.record_function(MARK):
                    step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # outside the range: not counted
    counts = count_events(_events(prof), n)
    return counts if device.type == "cuda" else {k: v for k, v in counts.items() if k not in DEVICE_KEYS}


def _events(prof):
    """Kineto's raw events. Not prof.events(): torch's FunctionEvents and their tree cost ~40 us an event,
    minutes for a per-parameter step of moe-8x64 (a million events)."""
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None:  # another torch: the slow, public way
        return [Ev(e.name, str(e.device_type).endswith("CUDA"), e.thread, int(e.time_range.start * 1000),
                   int(e.time_range.end * 1000), bool(getattr(e, "is_user_annotation", False)))
                for e in prof.events()]
    out = []
    for k in results.events():
        if getattr(k, "is_hidden_event", lambda: False)():
            continue
        if hasattr(k, "start_ns"):
            start, end = k.start_ns(), k.end_ns()
        else:  # torch 1.13: microseconds
            start = k.start_us() * 1000
            end = start + k.duration_us() * 1000
        out.append(Ev(k.name(), str(k.device_type()).endswith("CUDA"), k.start_thread_id(), start, end,
                      bool(getattr(k, "is_user_annotation", lambda: False)())))
    return out


def _api(name):
    return re.sub(r"_v\d+$", "", name)  # CUPTI adds versions: cudaLaunchKernelExC_v11060


def count_events(events, steps):
    """Counts per step from Ev events.

    Device activity (CUPTI sees every library in the process) is counted over the whole session: kernels,
    memcpy and memset; d2h = the device-to-host copies. Host events only inside the MARK ranges:
    launch_api = LAUNCH_APIS calls, syncs = SYNC_APIS calls, aten_all = every aten:: op, aten_top = the
    aten:: ops not nested in another aten:: op of the same thread (what the Python code called)."""
    windows = sorted((e.start, e.end) for e in events if e.name == MARK and not e.on_device)
    starts = [w[0] for w in windows]

    def inside(t):
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and t <= windows[i][1]
    counts = Counter()
    aten = defaultdict(list)  # thread -> (start, -end)
    for e in events:
        if e.name == MARK or e.annotation:
            continue
        if e.on_device:
            low = e.name.lower()
            kind = "memcpy" if low.startswith("memcpy") else "memset" if low.startswith("memset") else "kernels"
            counts[kind] += 1
            counts["d2h"] += kind == "memcpy" and "dtoh" in low
        elif inside(e.start):
            api = _api(e.name)
            counts["launch_api"] += api in LAUNCH_APIS
            counts["syncs"] += api in SYNC_APIS
            if e.name.startswith("aten::") and e.name not in HIDDEN_ATEN:
                aten[e.thread].append((e.start, -e.end))
    for spans in aten.values():
        spans.sort()  # parents before their children (same start: the longer first)
        open_ends = []  # ends of the aten ops enclosing the current one
        for start, neg_end in spans:
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            counts["aten_all"] += 1
            counts["aten_top"] += not open_ends
            open_ends.append(-neg_end)
    return {k: counts[k] / steps for k in KEYS}
