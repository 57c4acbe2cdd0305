#!/usr/bin/env python3
"""The front door, measured: one command, one run, the same threads, on one of the core's presets (CPU;
the preset's dtypes: gpt2-124m is fp32, moe-8x64 bf16).

Times, side by side in this one process (python and cpp in turns, each on the same fresh gradients):
  python     normuon.NorMuonAdamW.step() (table mode: the model's own tensors, in place)
  cpp        the native engine's step over the same tensors as the Python step bound them, reading none of
             them again (what the Python wrapper adds is the gap)
  reference  the per-parameter reference from Python (NorMuonAdamW(backend="reference"): the spec's steps one
             parameter after another, in C++)
  adamw      torch.optim.AdamW (default implementation) over every parameter

For each: median ms per step, ATen operators dispatched per step (TorchDispatchMode), optimizer bytes
per parameter element beyond the model's tensors, and, for this layout on the fast CUDA backend, the
launches per step from its plan and the host syncs per step of NorMuonAdamW (0 with the default
verdict="deferred", 1 with verdict="sync"). Writes <out>/python-step-<preset>.md and .csv.

  python3 bench/python_step.py                     # gpt2-124m, all processors
  python3 bench/python_step.py --preset moe-8x64 --skip-reference   # 1,595 parameters, bf16 (about 15 GB)
  python3 bench/python_step.py --preset tiny --repeats 1   # seconds: the smoke test
"""
import argparse
import csv
import datetime
import os
import statistics
import subprocess
import sys
import time

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import normuon
import normuon.native

class PresetParameters(nn.Module):
    """The parameters of one of the core's presets (`normuon presets`), named, shaped, typed as its manifest
    says; no forward needed. roles: {name: role} for the optimizer, as the manifest has them."""

    def __init__(self, name):
        super().__init__()
        manifest = normuon.native.require("python_step").preset_manifest(name)
        dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
        self.named = []
        self.roles = {}
        for k, spec in enumerate(manifest.params):
            p = nn.Parameter(torch.randn(spec.shape, dtype=dtypes[spec.dtype]) * 0.02)
            self.register_parameter(f"p{k}", p)
            self.named.append((spec.name, p))
            self.roles[spec.name] = spec.role


def fill_grads(model, step):
    """New values in the same gradient tensors (as zero_grad(set_to_none=False) or accumulation keeps
    them): the C++ contender steps the addresses the Python step bound."""
    g = torch.Generator().manual_seed(step)
    for p in model.parameters():
        values = (torch.randn(p.shape, generator=g) * 0.01).to(p.dtype)  # a gradient in its parameter's dtype
        if p.grad is None:
            p.grad = values
        else:
            p.grad.copy_(values)


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def measure(name, step, model, warmup, repeats, log):
    for s in range(warmup):
        fill_grads(model, s + 1)
        step()
    times = []
    for r in range(repeats):
        fill_grads(model, warmup + r + 1)
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
        log(f"  {name}: step {r + 1}/{repeats}: {times[-1]:.1f} ms")
    fill_grads(model, warmup + repeats + 1)
    with CountOps() as ops:
        step()
    return statistics.median(times), ops.count


def measure_pair(steps, model, warmup, repeats, log):
    """The Python step and the C++ step taken in turns, each on the same fresh gradients, so that a change
    of the machine's load falls on both. steps: {name: step}. Returns {name: (median ms, ATen ops)} and the
    median over the turns of python / cpp."""
    for s in range(warmup):
        for step in steps.values():
            fill_grads(model, s + 1)
            step()
    times = {name: [] for name in steps}
    for r in range(repeats):
        for name, step in steps.items():
            fill_grads(model, warmup + r + 1)
            t0 = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - t0) * 1e3)
            log(f"  {name}: step {r + 1}/{repeats}: {times[name][-1]:.1f} ms")
    out = {}
    for name, step in steps.items():
        fill_grads(model, warmup + repeats + 1)
        with CountOps() as ops:
            step()
        out[name] = (statistics.median(times[name]), ops.count)
    ratio = statistics.median(p / c for p, c in zip(times["python"], times["cpp"]))
    return out, ratio


def torch_state_bytes(opt):
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=normuon.native.require("python_step").preset_names(), default="gpt2-124m",
                    help="a preset of the core (normuon presets): the same model as the command line's")
    ap.add_argument("--threads", type=int, default=0, help="threads of every contender (0: one per processor)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-reference", action="store_true", help="leave out the slow per-parameter reference")
    ap.add_argument("--out", default="bench/results", help="folder of the .md and .csv reports")
    args = ap.parse_args(argv)
    if args.warmup < 0 or args.repeats < 1 or args.threads < 0:
        ap.error("--warmup >= 0, --repeats >= 1, --threads >= 0")
    threads = args.threads or os.cpu_count()
    torch.set_num_threads(threads)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    torch.manual_seed(0)
    model = PresetParameters(args.preset)
    numel = sum(p.numel() for p in model.parameters())
    log(f"{args.preset}: {numel / 1e6:.1f}M parameters, {threads} threads")
    rows = []

    opt = normuon.NorMuonAdamW(model.named, roles=model.roles, threads=threads)
    cuda, _ = normuon.native.cuda_module()  # the CUDA backend's module, where this build has one
    launches = cuda.cuda_launches_per_step(opt.layout, opt.engine.native.options) if cuda is not None else None
    mem = opt.memory_report()
    held = mem["state_bytes"] + mem["master_bytes"] + mem["workspace_bytes"]
    def native_step():  # the table the Python step bound (same gradient tensors), stepped by the engine alone
        opt.engine.native.step_bound()

    pair, ratio = measure_pair({"python": opt.step, "cpp": native_step}, model, args.warmup, args.repeats, log)
    # All the front door adds, bounded on its own: step() when no parameter has a gradient runs the Python
    # side, the native walk over the tensors and an empty native step, and none of the arithmetic.
    for p in model.parameters():
        p.grad = None
    empty = []
    for _ in range(50):
        t0 = time.perf_counter()
        opt.step()
        empty.append((time.perf_counter() - t0) * 1e3)
    overhead = statistics.median(empty)
    for name, syncs in (("python", "0 (1 with verdict='sync')"), ("cpp", "")):
        rows.append(dict(contender=name, ms=pair[name][0], ops=pair[name][1], bytes_per_param=held / numel,
                         state_bytes_per_param=(mem["state_bytes"] + mem["master_bytes"]) / numel,
                         cuda_launches=launches, cuda_syncs=syncs))
    del opt

    if not args.skip_reference:
        ref = normuon.NorMuonAdamW(model.named, roles=model.roles, backend="reference")
        mem = ref.memory_report()
        t, ops = measure("reference", ref.step, model, min(args.warmup, 1), 1, log)
        rows.append(dict(contender="reference", ms=t, ops=ops,
                         bytes_per_param=(mem["state_bytes"] + mem["master_bytes"]) / numel,
                         state_bytes_per_param=(mem["state_bytes"] + mem["master_bytes"]) / numel,
                         cuda_launches="", cuda_syncs=""))
        del ref

    adamw = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t, ops = measure("adamw", adamw.step, model, args.warmup, args.repeats, log)
    rows.append(dict(contender="adamw", ms=t, ops=ops, bytes_per_param=torch_state_bytes(adamw) / numel,
                     state_bytes_per_param=torch_state_bytes(adamw) / numel, cuda_launches="", cuda_syncs=""))

    by = {r["contender"]: r for r in rows}
    gap = ratio - 1  # the median over the turns: load that drifts between the turns does not count
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    head = (f"# Python front door vs the C++ step: {args.preset}, CPU, {threads} threads\n\n"
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit or '?'}, torch "
            f"{torch.__version__}, {numel / 1e6:.1f}M parameters. Command: `python3 bench/python_step.py "
            f"{' '.join(argv if argv is not None else sys.argv[1:])}`\n\n")
    lines = ["| contender | ms / step (median) | ATen ops / step | optimizer bytes / param | of which state + masters "
             "| fast-cuda launches / step | host syncs / step |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['contender']} | {r['ms']:.1f} | {r['ops']} | {r['bytes_per_param']:.2f} | "
                     f"{r['state_bytes_per_param']:.2f} | {r['cuda_launches'] or ''} | {r['cuda_syncs']} |")
    verdict = (f"\nPython step vs C++ step (median of the per-turn ratios): {100 * gap:+.1f}% (target within 3%: "
               f"{'met' if abs(gap) <= 0.03 else 'NOT met'}). Python vs the per-parameter reference: "
               + (f"{by['reference']['ms'] / by['python']['ms']:.1f}x faster." if "reference" in by else "not run.")
               + f"\nEverything the front door adds, bounded by step() with no gradients (the Python side, the native "
               f"walk over the {len(model.named)} tensors, an empty native step): {overhead:.3f} ms, "
               f"{100 * overhead / by['cpp']['ms']:.3f}% of the C++ step.\n")
    report = head + "\n".join(lines) + "\n" + verdict
    print(report)
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"python-step-{args.preset}")
    for path, text in ((base + ".md", report), (base + ".csv", None)):
        tmp = path + ".tmp"
        with open(tmp, "w", newline="") as f:
            if text is not None:
                f.write(text)
            else:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
        os.replace(tmp, path)  # atomic: a reader never sees half a report
    log(f"wrote {base}.md and .csv")


if __name__ == "__main__":
    main()
