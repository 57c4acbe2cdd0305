#!/usr/bin/env python3
"""Parameters that are not contiguous, measured: what NorMuonAdamW's step costs over each memory layout it takes,
side by side in one run with the same values laid out contiguously (same threads, interleaved repeats).

  contiguous       the baseline: every parameter row-major
  transposed       every matrix a transposed view (torch.randn(n, m).t()): dense, stepped where it lies, NorMuon's
                   matrices as the transposed matrices they are in memory
  strided          every parameter every other element of a larger tensor (torch's non-contiguous test case):
                   neither contiguous nor dense, stepped through a contiguous copy (read when written from
                   outside, written back after each step)
  channels_last    a stack of conv layers in channels_last (dense, stepped where it lies), against its
                   contiguous twin

For each: median ms per step, its ratio to its contiguous twin, and the bytes the optimizer holds beyond the
model's tensors (memory_report: the staged copies show in workspace_bytes). Writes <out>/memory-layouts-<preset>.md.

  python3 bench/memory_layouts.py                      # gpt2-124m and a 16-layer conv stack
  python3 bench/memory_layouts.py --preset tiny --repeats 2   # seconds: the smoke test
"""
import argparse
import datetime
import os
import platform
import statistics
import subprocess
import time

import torch

import normuon
import normuon.native


def preset_tensors(name):
    """(name, shape, role) of each parameter of one of the core's presets, as fp32."""
    manifest = normuon.native.require("memory_layouts").preset_manifest(name)
    return [(p.name, tuple(p.shape), p.role) for p in manifest.params]


def laid_out(shape, layout, generator):
    """A tensor of `shape` with random values, laid out as `layout` says (the values do not depend on it)."""
    values = torch.randn(shape, generator=generator) * 0.02
    if layout == "transposed" and len(shape) == 2:
        return values.t().contiguous().t()
    if layout == "strided":
        out = torch.empty(*shape, 2)[..., 0]
        return out.copy_(values)
    if layout == "channels_last" and len(shape) == 4:
        return values.contiguous(memory_format=torch.channels_last)
    return values


def build(specs, layout, threads):
    g = torch.Generator().manual_seed(0)
    params = [(n, torch.nn.Parameter(laid_out(s, layout, g))) for n, s, _ in specs]
    roles = {n: r for n, _, r in specs}
    return params, normuon.NorMuonAdamW(params, roles=roles, threads=threads)


def set_grads(params, step):
    g = torch.Generator().manual_seed(step)
    for _, p in params:
        values = torch.randn(p.shape, generator=g) * 0.01
        # As autograd lays them out: like the parameter where it is dense, contiguous otherwise.
        dense = p.is_contiguous() or 1 + sum((n - 1) * st for n, st in zip(p.shape, p.stride())) == p.numel()
        p.grad = torch.empty_like(p).copy_(values) if dense else values


def measure(pairs, repeats, warmup=1):
    """pairs: {label: (params, optimizer)}; interleaved: each repeat steps every contender once in turn."""
    times = {label: [] for label in pairs}
    for step in range(warmup + repeats):
        for label, (params, opt) in pairs.items():
            set_grads(params, step)
            start = time.perf_counter()
            opt.step()
            elapsed = time.perf_counter() - start
            if step >= warmup:
                times[label].append(elapsed * 1e3)
    return {label: statistics.median(t) for label, t in times.items()}


def conv_stack(layers, channels):
    return [(f"conv{k}.weight", (channels, channels, 3, 3), "other") for k in range(layers)] + \
        [(f"norm{k}.weight", (channels,), "norm") for k in range(layers)]


def commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--conv-layers", type=int, default=16)
    parser.add_argument("--conv-channels", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="the fast backend's threads (default: torch's)")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    threads = args.threads if args.threads is not None else torch.get_num_threads()

    rows = []
    specs = preset_tensors(args.preset)
    pairs = {layout: build(specs, layout, threads) for layout in ("contiguous", "transposed", "strided")}
    medians = measure(pairs, args.repeats)
    for layout in pairs:
        rows.append((args.preset, layout, medians[layout], medians[layout] / medians["contiguous"],
                     pairs[layout][1].memory_report()))
    conv = conv_stack(args.conv_layers, args.conv_channels)
    pairs = {layout: build(conv, layout, threads) for layout in ("contiguous", "channels_last")}
    medians = measure(pairs, args.repeats)
    label = f"conv {args.conv_layers}x{args.conv_channels}"
    for layout in pairs:
        rows.append((label, layout, medians[layout], medians[layout] / medians["contiguous"],
                     pairs[layout][1].memory_report()))

    lines = [f"# NorMuonAdamW over memory layouts ({datetime.date.today()})", "",
             f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} processors, {threads} threads",
             f"- torch {torch.__version__}, commit {commit()}, {args.repeats} interleaved repeats (medians)",
             f"- command: `python3 bench/memory_layouts.py --preset {args.preset} --conv-layers {args.conv_layers} "
             f"--conv-channels {args.conv_channels} --repeats {args.repeats}`", "",
             "| model | layout | step (ms) | vs contiguous | state (MB) | workspace (MB) |",
             "|---|---|---|---|---|---|"]
    for model, layout, ms, ratio, report in rows:
        lines.append(f"| {model} | {layout} | {ms:.1f} | {ratio:.2f}x | {report['state_bytes'] / 1e6:.1f} | "
                     f"{report['workspace_bytes'] / 1e6:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"memory-layouts-{args.preset}.md")
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
