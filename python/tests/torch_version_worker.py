"""Run by test_torch_versions.py under the other interpreter (another torch): trains, saves or resumes.

    python torch_version_worker.py save DIR DTYPE     steps 1-3, then DIR/sd.pt (torch.save) and DIR/state.safetensors
    python torch_version_worker.py resume DIR DTYPE   loads both into fresh optimizers, steps 4-5, writes DIR/resumed-*.pt
"""
import os
import sys

import torch

import normuon
from conftest import fill_grads, make_model, params_of

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def build(dtype, seed=0):
    model = make_model(seed=seed, dtype=DTYPES[dtype])
    return model, normuon.NorMuonAdamW(model, backend="fast", threads=1, weight_decay=0.1, adamw_weight_decay=0.05)


def train(model, opt, first, last):
    for step in range(first, last + 1):
        fill_grads(model, step)
        opt.step()


def save(out, dtype):
    model, opt = build(dtype)
    train(model, opt, 1, 3)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, os.path.join(out, "sd.pt"))
    opt.export_state(os.path.join(out, "state.safetensors"))


def resume(out, dtype):
    saved = torch.load(os.path.join(out, "sd.pt"))
    model, opt = build(dtype, seed=1)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    train(model, opt, 4, 5)
    torch.save(params_of(model), os.path.join(out, "resumed-sd.pt"))
    model, opt = build(dtype, seed=1)
    opt.import_state(os.path.join(out, "state.safetensors"))
    train(model, opt, 4, 5)
    torch.save(params_of(model), os.path.join(out, "resumed-file.pt"))


if __name__ == "__main__":
    {"save": save, "resume": resume}[sys.argv[1]](sys.argv[2], sys.argv[3])
