#!/usr/bin/env python3
"""Trains a small GPT-like model with NorMuonAdamW under FSDP2 (docs/distributed.md), saves a checkpoint with
torch.distributed.checkpoint and loads it back into a fresh model and optimizer.

    torchrun --nproc-per-node 2 python/examples/train_fsdp2.py --checkpoint DIR   # any launcher that sets the env
    python3 python/examples/train_fsdp2.py --spawn 2                              # or: this script starts 2 CPU ranks

Gloo on CPUs; with GPUs, NCCL and one GPU per rank. Rank 0 prints the loss of every step.
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


def build():
    model = TinyGPT()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, normuon.NorMuonAdamW(model, lr=0.02, adamw_lr=3e-3, weight_decay=0.01)


def train(steps, checkpoint):
    model, opt = build()
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
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=checkpoint)
    # A fresh model and optimizer resume from it (at this or any other world size).
    again, opt_again = build()
    both = {"model": get_model_state_dict(again), "optim": get_optimizer_state_dict(again, opt_again)}
    dcp.load(both, checkpoint_id=checkpoint)
    set_model_state_dict(again, both["model"])
    set_optimizer_state_dict(again, opt_again, both["optim"])
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), again.parameters()))
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
        train(args.steps, os.path.join(args.checkpoint, "dcp"))
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
    parser.add_argument("--checkpoint", help="a folder every rank can reach, for the checkpoint (with --spawn, by "
                                             "default a temporary one)")
    args = parser.parse_args()
    if args.steps < 1 or args.spawn < 0:
        parser.error("--steps >= 1, --spawn >= 0")
    if not args.spawn:  # launched: every rank is this process; they must share one folder
        if not args.checkpoint:
            parser.error("launched ranks need --checkpoint, a folder every rank can reach")
        rank_main(0, 0, args)
    with tempfile.TemporaryDirectory() as tmp:
        args.checkpoint = args.checkpoint or tmp
        torch.multiprocessing.start_processes(rank_main, args=(args.spawn, args), nprocs=args.spawn,
                                              start_method="spawn")


if __name__ == "__main__":
    main()
