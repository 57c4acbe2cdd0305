"""The zero-copy front door (table mode): step() dispatches no torch operator per parameter, the optimizer
holds its state and the masters of bf16/fp16 parameters and nothing else parameter-sized, and the model's
own tensors are stepped where they are, wherever they move."""
import math

import pytest
import torch

import normuon
from conftest import count_ops, fill_grads, make_model

pytestmark = pytest.mark.usefixtures("native")


def ops_per_step(n_layer, dtype, backend):
    model = make_model(n_layer=n_layer, dtype=dtype)
    opt = normuon.NorMuonAdamW(model.named_parameters(), backend=backend)
    fill_grads(model, 1)
    opt.step()  # the first step binds the table
    fill_grads(model, 2)
    with count_ops() as count:
        opt.step()
    return count.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_per_step_do_not_grow_with_the_model(dtype):
    small, large = ops_per_step(2, dtype, "fast"), ops_per_step(24, dtype, "fast")
    assert len(small) == len(large), (small, large)
    # The step itself dispatches none: what is left is torch.optim's record_function around step()
    # (torch 1.13: aten.zeros and profiler._record_function_enter).
    assert len(small) <= 2, small


def test_the_old_path_dispatches_ops_per_parameter():
    """The measure can tell: the per-parameter reference grows with the layer count."""
    assert len(ops_per_step(4, torch.float32, "reference")) > len(ops_per_step(2, torch.float32, "reference"))


def _padded(n):
    return (n + 15) // 16 * 16  # the layout's 64-byte slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_memory_is_the_state_plus_masters_of_low_precision_parameters(dtype):
    model = make_model(n_layer=3, dtype=dtype)
    opt = normuon.NorMuonAdamW(model.named_parameters())
    state = masters = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if any(row["name"] == name and row["algorithm"] == "normuon" for row in opt.routing_table()):
            rows, cols = p.shape
            state += _padded(n) + _padded(rows)  # momentum, and the per-row second moment
        else:
            state += 2 * _padded(n)               # exp_avg, exp_avg_sq
        masters += _padded(n) if dtype != torch.float32 else 0
    report = opt.memory_report()
    assert report["state_bytes"] == 4 * state
    assert report["master_bytes"] == 4 * masters
    # No copy of the parameters or gradients: the workspace (Newton-Schulz buffers) does not grow with
    # the AdamW parameters (a 16x larger vocabulary leaves it as it is).
    big = normuon.NorMuonAdamW(make_model(n_layer=3, dtype=dtype, vocab=1024).named_parameters())
    assert big.memory_report()["workspace_bytes"] == report["workspace_bytes"]
    assert big.memory_report()["state_bytes"] > report["state_bytes"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_tensors_are_the_operands(dtype):
    """An fp32 parameter is stepped in place (same storage, no copy); a gradient at a new address every step
    (zero_grad(set_to_none=True)) is read where it is; results equal a run whose addresses never moved."""
    a, b = make_model(dtype=dtype), make_model(dtype=dtype)
    opt_a = normuon.NorMuonAdamW(a.named_parameters())
    opt_b = normuon.NorMuonAdamW(b.named_parameters())
    ptrs = [p.data_ptr() for p in a.parameters()]
    for s in range(1, 4):
        fill_grads(a, s)
        opt_a.step()
        opt_a.zero_grad(set_to_none=True)
        fill_grads(b, s)
        keep = [p.grad for p in b.parameters()]  # b's gradients: fresh tensors each step too, but kept alive
        opt_b.step()
        for p in b.parameters():
            p.grad = p.grad.clone()  # moves every gradient to another address
        del keep
    assert [p.data_ptr() for p in a.parameters()] == ptrs
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_parameters_moved_by_data_assignment_are_followed():
    """p.data = other tensor: the next step binds the new storage."""
    model = make_model()
    opt = normuon.NorMuonAdamW(model.named_parameters())
    fill_grads(model, 1)
    opt.step()
    w = model.blocks[0].attn.weight
    moved = w.detach().clone()
    w.data = moved
    before = moved.clone()
    fill_grads(model, 2)
    opt.step()
    assert not torch.equal(moved, before)  # the new storage was stepped


def test_a_non_contiguous_gradient_is_read_correctly():
    a, b = make_model(), make_model()
    opt_a, opt_b = normuon.NorMuonAdamW(a.named_parameters()), normuon.NorMuonAdamW(b.named_parameters())
    fill_grads(a, 1)
    fill_grads(b, 1)
    for p in b.parameters():
        if p.dim() == 2:
            p.grad = p.grad.t().contiguous().t()  # same values, transposed strides
            assert not p.grad.is_contiguous()
    opt_a.step()
    opt_b.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
