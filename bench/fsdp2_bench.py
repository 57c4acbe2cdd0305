#!/usr/bin/env python3
"""Step time and communicated bytes of NorMuonAdamW under FSDP2 against world size, beside
torch.optim.AdamW under the same FSDP2 setup (docs/distributed.md).

For every world size asked, spawns that many ranks on this machine (Gloo, FileStore rendezvous in a
temporary folder), builds the model, shards it with fully_shard (each block, then the root) and gives every
parameter the same gradient on every rank (a DTensor laid out as its parameter). Each measured step starts at
a barrier; its time is the slowest rank's opt.step(). Reported: the median [min - max] over the measured
steps, and the bytes the slowest-sending rank sent per step (counted by the optimizer from the buffers it
hands to collectives: last_step_comm). The cores are shared: each rank gets cores / world threads.

    PYTHONPATH=build/python .venv-torch2/bin/python bench/fsdp2_bench.py --model gpt --world-sizes 1,2,4 \\
        --out bench/results/cpu-fsdp2-$(date -u +%F).md
    # GPUs: NCCL, one GPU per rank (world sizes up to the GPU count)
    PYTHONPATH=build-gpu/python python3 bench/fsdp2_bench.py --device cuda --world-sizes 1 --out fsdp2.md
"""
import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import normuon

MODELS = {  # name: keyword arguments of Model (a GPT-2 style stack; experts > 0: an MoE MLP per block)
    "gpt": dict(vocab=8192, d=384, layers=6, experts=0),
    "gpt2-124m": dict(vocab=50257, d=768, layers=12, experts=0),
    "moe": dict(vocab=8192, d=256, layers=4, experts=8),
}


class Block(nn.Module):
    def __init__(self, d, experts):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        if experts:
            self.router = nn.Linear(d, experts, bias=False)
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d, bias=False), nn.Linear(2 * d, d, bias=False))
                                         for _ in range(experts))
        else:
            self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)


class Model(nn.Module):
    def __init__(self, vocab, d, layers, experts):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(1024, d)
        self.h = nn.ModuleList(Block(d, experts) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)


def worker(rank, world, store, args, out):
    torch.set_num_threads(max(1, args.cores // world))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method="file://" + store, rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import distribute_tensor

        mesh = init_device_mesh(args.device, (world,))  # (named: fully_shard's default follows CUDA when it is there)
        rows = {}
        for name in ("normuon", "adamw"):
            model = Model(**MODELS[args.model])
            for block in model.h:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            for k, p in enumerate(model.parameters()):  # the same gradient on every rank, laid out as p
                g = torch.randn(p.shape, generator=torch.Generator().manual_seed(k)) * 0.01
                p.grad = distribute_tensor(g.to(p.device), p.device_mesh, p.placements)
            opt = (normuon.NorMuonAdamW(model, threads=max(1, args.cores // world)) if name == "normuon" else
                   torch.optim.AdamW(model.parameters(), lr=1e-3))
            times, sent = [], 0
            for step in range(args.warmup + args.steps):
                dist.barrier()
                start = time.perf_counter()
                opt.step()
                if cuda:
                    torch.cuda.synchronize()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=mesh.device_type)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank
                if step >= args.warmup:
                    times.append(float(elapsed))
            if name == "normuon":
                sent = torch.tensor([opt.last_step_comm["bytes_sent"]], dtype=torch.int64, device=mesh.device_type)
                dist.all_reduce(sent, op=dist.ReduceOp.MAX)
                sent = int(sent)
            rows[name] = dict(times=times, sent=sent, params=sum(p.numel() for p in model.parameters()))
        if rank == 0:
            torch.save(rows, out)
    finally:
        dist.destroy_process_group()
    # No interpreter finalization: with FSDP imported, Gloo's threads outlive the group, and one still dropping a
    # finished collective's tensor while the interpreter finalizes aborts the process.
    sys.stdout.flush()
    os._exit(0)


def ms(values):
    return f"{statistics.median(values) * 1e3:,.1f} [{min(values) * 1e3:,.1f} - {max(values) * 1e3:,.1f}]"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt",
                        help="gpt (d 384, 6 layers), gpt2-124m (d 768, 12 layers), moe (d 256, 4 layers, 8 experts)")
    parser.add_argument("--world-sizes", default="1,2,4", help="comma-separated (default 1,2,4)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps first (default 1)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu (Gloo) or cuda (NCCL, one GPU per rank); default cpu")
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="cores shared by the ranks of one run")
    parser.add_argument("--out", help="append the markdown report here (default: print only)")
    args = parser.parse_args()
    worlds = [int(w) for w in args.world_sizes.split(",")]
    if args.steps < 1 or args.warmup < 0 or args.cores < 1 or any(w < 1 for w in worlds):
        parser.error("--steps >= 1, --warmup >= 0, --cores >= 1, world sizes >= 1")
    if args.device == "cuda" and max(worlds) > torch.cuda.device_count():
        parser.error(f"--device cuda: a world size of {max(worlds)} needs as many GPUs ({torch.cuda.device_count()} here)")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"## {args.model} ({MODELS[args.model]}), {datetime.date.today()}, commit {commit}", "",
             f"{platform.machine()}, {os.cpu_count()} cores ({args.cores} shared by the ranks), torch {torch.__version__}, "
             f"{'NCCL on ' + torch.cuda.get_device_name() if args.device == 'cuda' else 'Gloo'}; `{' '.join(['bench/fsdp2_bench.py'] + sys.argv[1:])}`", "",
             "| world | NorMuonAdamW step, ms | torch AdamW step, ms | ratio | NorMuon bytes sent / step (max rank) |",
             "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            began = time.perf_counter()
            out = os.path.join(tmp, f"w{world}.pt")
            mp.start_processes(worker, args=(world, os.path.join(tmp, f"store-{world}"), args, out), nprocs=world,
                               join=True, start_method="spawn")
            rows = torch.load(out)
            ratio = statistics.median(rows["normuon"]["times"]) / statistics.median(rows["adamw"]["times"])
            lines.append(f"| {world} | {ms(rows['normuon']['times'])} | {ms(rows['adamw']['times'])} | {ratio:.2f}x | "
                         f"{rows['normuon']['sent']:,} |")
            print(f"world {world}: done in {time.perf_counter() - began:.0f} s ({rows['normuon']['params']:,} "
                  "parameters)", file=sys.stderr, flush=True)
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "a") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
