#!/usr/bin/env python3
"""Step time and communicated bytes of DistributedNorMuonAdamW against world size (docs/distributed.md).

DistributedNorMuonAdamW is NorMuonAdamW(process_group=), the same path FSDP2 takes: each NorMuon matrix
has one owner rank, which runs its Newton-Schulz and sends the new values to the other ranks in one
all_to_all; a 24-byte all_reduce carries the NaN/Inf verdict; AdamW runs on every rank (it sends nothing).

Spawns W ranks on this machine for every world size asked (FileStore rendezvous in a temporary folder),
on a model with the parameters of the `tiny` preset (GPT-2 style, 4 layers, d_model 256, vocab 4096,
untied head, fp32). Every rank gets the same gradients (as after a data-parallel all-reduce). Before each
measured step the ranks meet at a barrier; a step's time is the slowest rank's opt.step(), reported as the
median [min - max] over the measured steps. Bytes are counted by the optimizer from the buffers it hands to
collectives (DistributedNorMuonAdamW.last_step_comm), not estimated. The final parameters of every run
are hashed and compared with a single-process NorMuonAdamW run.

    PYTHONPATH=build/python /usr/bin/python3 bench/distributed_bench.py \\
        --out bench/results/cpu-gloo-distributed-$(date -u +%F).md
    # GPUs (one per rank; the optimizer's maths stays on the CPU, the exchange goes through NCCL):
    PYTHONPATH=build/python python3 bench/distributed_bench.py --dist-backend nccl --world-sizes 1,2,4
"""
import argparse
import datetime
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import normuon
from normuon.distributed import DistributedNorMuonAdamW


def tiny_preset_shapes(vocab=4096, context=256, d=256, layers=4):
    """The `tiny` preset's parameters in named_parameters() order (core/src/presets.cpp)."""
    shapes = [("transformer.wte.weight", (vocab, d)), ("transformer.wpe.weight", (context, d))]
    for i in range(layers):
        h = f"transformer.h.{i}"
        shapes += [(f"{h}.ln_1.weight", (d,)), (f"{h}.ln_1.bias", (d,)),
                   (f"{h}.attn.c_attn.weight", (3 * d, d)), (f"{h}.attn.c_attn.bias", (3 * d,)),
                   (f"{h}.attn.c_proj.weight", (d, d)), (f"{h}.attn.c_proj.bias", (d,)),
                   (f"{h}.ln_2.weight", (d,)), (f"{h}.ln_2.bias", (d,)),
                   (f"{h}.mlp.c_fc.weight", (4 * d, d)), (f"{h}.mlp.c_fc.bias", (4 * d,)),
                   (f"{h}.mlp.c_proj.weight", (d, 4 * d)), (f"{h}.mlp.c_proj.bias", (d,))]
    shapes += [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,)), ("lm_head.weight", (vocab, d))]
    return shapes


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(name, torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)) for name, shape in tiny_preset_shapes()]


def fill_grads(params, step):
    """The same gradients on every rank (what data parallelism's all-reduce leaves), with per-row gains."""
    g = torch.Generator().manual_seed(1000 + step)
    for _, p in params:
        grad = torch.randn(p.shape, generator=g)
        if p.dim() == 2:
            grad *= torch.logspace(-2, 2, p.shape[0], base=2.0).unsqueeze(1)
        p.grad = grad


def params_hash(params):
    h = hashlib.sha256()
    for name, p in params:
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


OPT_KW = dict(lr=0.02, weight_decay=0.1, adamw_lr=3e-4, adamw_weight_decay=0.1)


def worker(rank, world, store, threads, args, out):
    torch.set_num_threads(threads)
    if args.dist_backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(args.dist_backend, init_method="file://" + store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        params = make_params()
        opt = DistributedNorMuonAdamW(params, backend=args.backend, threads=threads, **OPT_KW)
        rows = []
        for step in range(1, args.warmup + args.steps + 1):
            fill_grads(params, step)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            opt.step()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if step > args.warmup:
                rows.append(dict(wall=wall, cpu=cpu, **opt.last_step_comm))
        table = opt.ownership_table()  # AdamW rows have owner "all": owned_numel counts NorMuon matrices only
        flops = [sum(r["cost"] for r in table if r["owner"] == k and r["algorithm"] == "normuon") for k in range(world)]
        result = dict(rank=rank, rows=rows, hash=params_hash(params), backend=opt.backend, ns_flops=flops,
                      matrices=[sum(1 for r in table if r["owner"] == k and r["algorithm"] == "normuon")
                                for k in range(world)],
                      owned_numel=[sum(torch.Size(r["shape"]).numel() for r in table if r["owner"] == k)
                                   for k in range(world)])
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def single_process(args, threads):
    """The plain NorMuonAdamW on one process with all threads: the baseline and the bit-identity target."""
    torch.set_num_threads(threads)
    params = make_params()
    opt = normuon.NorMuonAdamW(params, backend=args.backend, threads=threads, **OPT_KW)
    walls, cpu = [], []
    for step in range(1, args.warmup + args.steps + 1):
        fill_grads(params, step)
        t0, c0 = time.perf_counter(), time.process_time()
        opt.step()
        if step > args.warmup:
            walls.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return walls, cpu, params_hash(params), opt.backend


def threads_per_rank(world, args):
    return args.threads_per_rank or max(1, args.cores // world)


def run_world(world, args):
    threads = threads_per_rank(world, args)
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, args=(world, os.path.join(out, "store"), threads, args, out),
                           nprocs=world, join=True, start_method="spawn")
        ranks = []
        for r in range(world):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    steps = [[ranks[r]["rows"][i] for r in range(world)] for i in range(args.steps)]
    walls = [max(row["wall"] for row in step) for step in steps]
    cpu = [max(row["cpu"] for row in step) for step in steps]
    first = ranks[0]["rows"][0]
    return dict(world=world, threads=threads, walls=walls, cpu=cpu,
                collectives=first["collectives"], sent=first["bytes_sent"], received=first["bytes_received"],
                hashes={r["hash"] for r in ranks}, matrices=ranks[0]["matrices"], ns_flops=ranks[0]["ns_flops"],
                owned_numel=ranks[0]["owned_numel"], backend=ranks[0]["backend"])


def ms(values):
    values = [v * 1e3 for v in values]
    return f"{statistics.median(values):.1f} [{min(values):.1f} - {max(values):.1f}]"


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="1,2,3,4", help="comma-separated (default 1,2,3,4)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (default 2)")
    parser.add_argument("--backend", default="fast", help="the optimizer backend of every rank (default fast)")
    parser.add_argument("--dist-backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="cores shared by the ranks of one run")
    parser.add_argument("--threads-per-rank", type=int, default=0,
                        help="threads of each rank and of the single process (default: max(1, cores // W))")
    parser.add_argument("--out", help="write the markdown report here (default: print only)")
    parser.add_argument("--append", action="store_true", help="append to --out instead of replacing it")
    args = parser.parse_args()
    worlds = [int(w) for w in args.world_sizes.split(",")]
    load_before = os.getloadavg()[0]
    started = datetime.datetime.now(datetime.timezone.utc)

    base_threads = threads_per_rank(1, args)
    base_walls, base_cpu, base_hash, base_backend = single_process(args, base_threads)
    runs = []
    for world in worlds:
        run = run_world(world, args)
        runs.append(run)
        print(f"world {world}: step {ms(run['walls'])} ms, sent {run['sent']:,} B/step", flush=True)

    threads_text = (f"{args.threads_per_rank} per rank" if args.threads_per_rank
                    else f"max(1, {args.cores} // W) per rank")
    numel = sum(torch.Size(s).numel() for _, s in tiny_preset_shapes())
    nm_numel = sum(torch.Size(s).numel() for n, s in tiny_preset_shapes()
                   if len(s) == 2 and not n.startswith(("transformer.wte", "transformer.wpe", "lm_head")))
    lines = [f"# Distributed NorMuon ({args.dist_backend}): step time and bytes against world size, "
             f"{started:%Y-%m-%d}", "",
             "`bench/distributed_bench.py` (docs/distributed.md): `DistributedNorMuonAdamW`, which is "
             "`NorMuonAdamW(process_group=)` (the same path FSDP2 takes), on W ranks of this machine, every rank "
             "with the same gradients. Each NorMuon matrix has one owner rank, which runs its Newton-Schulz and "
             "sends the new values to the other ranks in one all_to_all; a 24-byte all_reduce carries the NaN/Inf "
             "verdict; AdamW runs on every rank. Each step's time is the slowest rank's `opt.step()` "
             "(after a barrier), median [min - max] over the measured steps; bytes are counted from the buffers "
             "handed to collectives (per rank and step). CPU ms is the busiest rank's process CPU time during "
             "`opt.step()` (all its threads): the work each rank does, which other jobs on the machine disturb "
             "less than the wall time.", "",
             "| | |", "|---|---|",
             f"| device | {cpu_name()}, {os.cpu_count()} logical CPUs; {platform.system()} {platform.release()} |",
             f"| software | Python {platform.python_version()}, torch {torch.__version__} "
             f"({args.dist_backend}), optimizer backend `{base_backend}` |",
             f"| date | {started:%Y-%m-%d %H:%M} UTC; 1-minute load average {load_before:.2f} before the run, "
             f"{os.getloadavg()[0]:.2f} after |",
             f"| command | `PYTHONPATH=build/python /usr/bin/python3 bench/distributed_bench.py "
             f"{' '.join(sys.argv[1:])}` |",
             f"| model | the `tiny` preset's parameters: {numel:,} floats, {nm_numel:,} of them in 16 NorMuon "
             f"matrices (4 shapes), fp32 |",
             f"| steps | {args.warmup} warm-up, {args.steps} measured; `lr=0.02, weight_decay=0.1`, AdamW "
             f"`lr=3e-4, weight_decay=0.1`, bf16 Newton-Schulz (quintic, 5 steps) |",
             f"| threads | {threads_text} (fast backend and torch), {args.cores} cores shared by the ranks; "
             f"W x threads > {args.cores} oversubscribes them |", "",
             f"Single process (`NorMuonAdamW`, {base_threads} threads): step {ms(base_walls)} ms wall, "
             f"{ms(base_cpu)} ms CPU.", "",
             "| W | threads/rank | step ms (wall) | CPU ms per rank (the busiest) | collectives/step "
             "| bytes sent/rank/step | bytes received/rank/step | matrices per rank | NS GFLOP per rank "
             "| bit-identical to 1 process |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        same = "yes" if run["hashes"] == {base_hash} else f"NO ({', '.join(sorted(run['hashes']))} vs {base_hash})"
        gflops = "/".join(f"{f / 1e9:.2f}" for f in run["ns_flops"])
        lines.append(f"| {run['world']} | {run['threads']} | {ms(run['walls'])} | {ms(run['cpu'])} "
                     f"| {run['collectives']} | {run['sent']:,} | {run['received']:,} "
                     f"| {'/'.join(map(str, run['matrices']))} | {gflops} | {same} |")
    text = "\n".join(lines) + "\n"
    if args.append:  # a further section of the same results file
        text = "#" + text
    print(text)
    if args.out:
        with open(args.out, "a" if args.append else "w") as f:
            f.write(("\n" if args.append else "") + text)


if __name__ == "__main__":
    main()
