"""Running one Python peer on one preset: a fresh model, a fresh optimizer, warm-up, timed steps, memory,
profiled steps; everything freed before the next peer."""
import sys
import time
import traceback
from dataclasses import dataclass

import torch

from . import counts, measure
from .model import DTYPE_NAMES, Model
from .optimizers import Skip
from .report import Row


@dataclass
class Plan:
    warmup: int
    steps: int
    profile_steps: int


def run_python_peer(peer, preset, specs, ctx, dtype_of, plan, seed, log):
    """One Row; a peer that cannot start is 'skipped', one that raises is 'failed', both with the reason."""
    model_dtype = DTYPE_NAMES[dtype_of(specs[0])]
    row = Row(preset=preset, peer=peer.name, param_dtype=model_dtype, warmup=plan.warmup, steps=plan.steps)
    try:
        make, notes = peer.prepare(ctx)
    except Skip as why:
        row.status, row.reason = "skipped", str(why)
        log(f"{peer.name}: skipped ({why})")
        return row
    row.notes = list(notes)
    storage = torch.float32 if peer.fp32_only else None
    if storage is not None and model_dtype != "f32":
        row.param_dtype = "f32"
        row.notes.append(f"stepped fp32 copies of the {model_dtype} model (values equal)")
    if peer.mutates_grads:
        row.notes.append("writes into p.grad (Nesterov blend): the gradients are restored outside the timed "
                         "region before each timed step")
    model = step = None
    t0 = time.perf_counter()
    try:
        model = Model(specs, ctx.device, dtype_of, seed, storage=storage, keep_pristine=peer.mutates_grads)
        probe = measure.MemoryProbe(ctx.device)
        probe.start()
        step, more = make(model)
        row.notes += more
        restore = model.restore_grads if peer.mutates_grads else None
        measure.run_steps(step, plan.warmup, ctx.device, restore)
        times, walls = measure.run_steps(step, plan.steps, ctx.device, restore)
        row.step_ms, row.wall_ms = measure.Series.of(times), measure.Series.of(walls)
        row.memory = probe.stop()
        log(f"{peer.name}: step {row.step_ms.median:.3f} ms median of {plan.steps}, "
            f"extra memory {_mib(row.memory['extra_mib'])}")
        if plan.profile_steps:
            try:
                row.counts = counts.profile_steps(step, plan.profile_steps, ctx.device)
                if ctx.device.type == "cuda" and not row.counts["kernels"]:
                    row.notes.append("the profiler saw no CUDA kernels (CUPTI not working?): device counts invalid")
            except Exception as error:  # the times stand without the counts
                row.notes.append(f"profiling failed ({type(error).__name__}: {error}): no counts")
                log(f"{peer.name}: profiling failed ({type(error).__name__}: {error})")
    except Exception as error:  # reported in the table; the run goes on with the next peer
        row.status, row.reason = "failed", f"{type(error).__name__}: {error}".strip()
        if peer.f32_hint and row.param_dtype == "f32":
            row.reason += f" ({peer.f32_hint})"
        log(f"{peer.name}: FAILED ({row.reason})")
        traceback.print_exc(file=sys.stderr)
    finally:
        model = step = None  # noqa: F841 (the last references: the memory goes back before the next peer)
        measure.release(ctx.device)
    log(f"{peer.name}: done in {time.perf_counter() - t0:.1f} s")
    return row


def _mib(x):
    return "n/a" if x is None else f"{x:.1f} MiB"
