"""Trains a tiny GPT-like torch model for a few steps with NorMuonAdamW and prints the loss.

    PYTHONPATH=build/python python3 python/examples/train_tiny.py [--steps 30] [--backend auto|fast|reference]
        [--bf16] [--save state.safetensors]

The task: predict the next token of sequences that count up modulo the vocabulary from a random start,
which a two-layer model learns within a few dozen steps.
"""
import argparse

import torch
from torch import nn

import normuon


class Block(nn.Module):
    def __init__(self, d, heads=4):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=32, d=64, n_layer=2, ctx=32):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for block in self.blocks:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))


def batch(generator, vocab=32, size=16, length=24):
    start = torch.randint(0, vocab, (size, 1), generator=generator)
    return (start + torch.arange(length + 1)) % vocab


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--backend", default=None, help="auto | fast | reference (default: NORMUON_BACKEND, auto)")
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters (the optimizer keeps fp32 masters)")
    parser.add_argument("--save", help="export the optimizer state file here at the end")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = TinyGPT()
    if args.bf16:
        model = model.to(torch.bfloat16)
    # nn.MultiheadAttention keeps its q/k/v projections in one [3d, d] matrix (in_proj_weight): NorMuon
    # normalises its rows like any other matrix's. Embeddings, the head, norms and biases go to AdamW.
    optimizer = normuon.NorMuonAdamW(model.named_parameters(), lr=0.02, weight_decay=0.01,
                                     adamw_lr=3e-3, adamw_weight_decay=0.0, backend=args.backend)
    optimizer.print_routing()
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 5))  # warm-up

    generator = torch.Generator().manual_seed(1)
    for step in range(1, args.steps + 1):
        tokens = batch(generator)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        print(f"step {step:3d}  loss {loss.item():.4f}  lr {optimizer.param_groups[0]['lr']:.4f}")
    if args.save:
        optimizer.export_state(args.save)
        print(f"saved optimizer state to {args.save} (inspect it with: normuon inspect {args.save})")


if __name__ == "__main__":
    main()
