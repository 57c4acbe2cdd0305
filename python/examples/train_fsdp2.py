#!/usr/bin/env python3
"""Trains a small GPT-like model with NorMuonAdamW on several ranks (docs/distributed.md), saves a checkpoint
with torch.distributed.checkpoint and loads it back into a fresh model and optimizer.

    torchrun --nproc-per-node 2 python/examples/train_fsdp2.py --checkpoint DIR   # any launcher that sets the env
    python3 python/examples/train_fsdp2.py --spawn 2                              # or: this script starts 2 CPU ranks
    python3 python/examples/train_fsdp2.py --spawn 4 --layout fsdp-tp             # FSDP x TP on a 2 x 2 mesh
    python3 python/examples/train_fsdp2.py --spawn 2 --layout ddp                 # DDP, process_group=

Layouts: fsdp2 (fully_shard on every block and the model), fsdp-tp (tensor parallel inside each block on the
mesh's "tp" dimension, fully_shard over "dp", as torchtitan lays it out) and ddp (DistributedDataParallel,
plain tensors). CPU ranks over Gloo here; on GPUs, NCCL, one GPU per rank and a "cuda" mesh instead.
Rank 0 prints the loss of every step.
"""
import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard

import normuon


class TinyGPT(nn.Module):
    """Token and position embeddings, MLP blocks with residuals, a norm and an untied head."""

    def __init__(self, vocab=64, d=32, layers=2, context=16):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                    for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        h = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            h = h + block(h)
        return self.lm_head(self.ln_f(h))


def build(layout):
    """The model laid out over the ranks, and its optimizer: (what the training loop calls, what owns the
    parameters, the optimizer)."""
    model = TinyGPT()
    if layout == "ddp":  # plain tensors every rank holds whole; the optimizer spreads Newton-Schulz over the group
        wrapped = nn.parallel.DistributedDataParallel(model)
        return wrapped, model, normuon.NorMuonAdamW(model, lr=0.02, adamw_lr=3e-3, weight_decay=0.01,
                                                    process_group=dist.group.WORLD)
    mesh = None
    if layout == "fsdp-tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:  # the MLP's first Linear split by columns, the second by rows
            parallelize_module(block, mesh["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
        mesh = mesh["dp"]
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, model, normuon.NorMuonAdamW(model, lr=0.02, adamw_lr=3e-3, weight_decay=0.01)


def whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train(steps, checkpoint, layout):
    model, params, opt = build(layout)
    data = torch.Generator().manual_seed(1)  # the same batches on every rank, for a reproducible example
    for step in range(1, steps + 1):
        tokens = torch.randint(0, 64, (8, 16), generator=data)
        tokens[:, 1::2] = tokens[:, ::2]  # something to learn: every other token repeats the one before
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dcp.save({"model": get_model_state_dict(params), "optim": get_optimizer_state_dict(params, opt)},
             checkpoint_id=checkpoint)
    # A fresh model and optimizer resume from it (at this or any other world size).
    _, params_again, opt_again = build(layout)
    both = {"model": get_model_state_dict(params_again), "optim": get_optimizer_state_dict(params_again, opt_again)}
    dcp.load(both, checkpoint_id=checkpoint)
    set_model_state_dict(params_again, both["model"])
    set_optimizer_state_dict(params_again, opt_again, both["optim"])
    same = all(torch.equal(whole(a), whole(b)) for a, b in zip(params.parameters(), params_again.parameters()))
    if dist.get_rank() == 0:
        print(f"resumed from {checkpoint}: parameters {'equal' if same else 'DIFFER'}; "
              f"bytes sent per step {opt.last_step_comm['bytes_sent']:,}", flush=True)


def rank_main(rank, world, args):
    if world:  # spawned here: a FileStore rendezvous
        dist.init_process_group("gloo", init_method="file://" + os.path.join(args.checkpoint, "store"), rank=rank,
                                world_size=world)
    else:
        dist.init_process_group("gloo")
    try:
        torch.set_num_threads(1)
        train(args.steps, os.path.join(args.checkpoint, "dcp"), args.layout)
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's finalization: once FSDP is imported, torch keeps the group (and Gloo's worker
    # threads) past destroy_process_group, and a worker still dropping a finished collective's tensor while the
    # interpreter finalizes aborts the process (terminate called without an active exception).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--spawn", type=int, default=0, help="start this many CPU ranks here (default: launched)")
    parser.add_argument("--layout", choices=("fsdp2", "fsdp-tp", "ddp"), default="fsdp2",
                        help="how the model lies on the ranks (default fsdp2; fsdp-tp needs an even rank count)")
    parser.add_argument("--checkpoint", help="a folder every rank can reach, for the checkpoint (with --spawn, by "
                                             "default a temporary one)")
    args = parser.parse_args()
    if args.steps < 1 or args.spawn < 0:
        parser.error("--steps >= 1, --spawn >= 0")
    world = args.spawn or int(os.environ.get("WORLD_SIZE", "1"))
    if args.layout == "fsdp-tp" and world % 2:
        parser.error(f"--layout fsdp-tp needs an even number of ranks (a dp x 2 mesh), not {world}")
    if not args.spawn:  # launched: every rank is this process; they must share one folder
        if not args.checkpoint:
            parser.error("launched ranks need --checkpoint, a folder every rank can reach")
        rank_main(0, 0, args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        args.checkpoint = args.checkpoint or tmp
        torch.multiprocessing.start_processes(rank_main, args=(args.spawn, args), nprocs=args.spawn,
                                              start_method="spawn")


if __name__ == "__main__":
    main()
