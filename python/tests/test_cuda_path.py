"""NorMuonAdamW's CUDA path without a GPU: the CUDA engine's backend with its device code on the SIMT emulator
(normuon_emulated, tests/emulated_engine_module.cpp) over CPU tensors. The host side is the one a GPU runs:
the engine enqueues each step, reads its verdict now or at the next step (verdict='deferred'), rolls the
counters of a skipped step back, and refreshes masters with the device's kernels."""
import math

import pytest
import torch

import normuon
from conftest import emulated_cuda_backend, fill_grads, make_model, params_of

pytestmark = pytest.mark.usefixtures("native")


def _opt(model, **kw):
    return normuon.NorMuonAdamW(model.named_parameters(), _device_backend=emulated_cuda_backend(), **kw)


def test_the_cuda_path_steps_as_the_cpu_does():
    """AdamW's parameters bit for bit, NorMuon's within fp32 Newton-Schulz's rounding (cuBLASLt's summation
    order, emulated, against oneDNN's); the counters exactly."""
    cpu, emu = make_model(), make_model()
    a, b = normuon.NorMuonAdamW(cpu.named_parameters(), ns_precision="fp32"), _opt(emu, ns_precision="fp32")
    assert b.backend == "fast-cuda-emulated"
    for step in range(1, 4):
        fill_grads(cpu, step, skip=("blocks.0.mlp_fc.weight",) if step == 2 else ())
        fill_grads(emu, step, skip=("blocks.0.mlp_fc.weight",) if step == 2 else ())
        a.step()
        b.step()
    on_cpu, on_emu = params_of(cpu), params_of(emu)
    normuon_names = {r["name"] for r in a.routing_table() if r["algorithm"] == "normuon"}
    assert all(torch.equal(on_cpu[n], on_emu[n]) for n in on_cpu if n not in normuon_names)
    assert all(torch.allclose(on_cpu[n], on_emu[n], rtol=0, atol=1e-6) for n in normuon_names)
    assert [g["step"] for g in a.param_groups] == [g["step"] for g in b.param_groups] == [3, 3]
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert [float(s["step"]) for s in sa.values()] == [float(s["step"]) for s in sb.values()]
    assert b.memory_report()["state_bytes"] == a.memory_report()["state_bytes"]


@pytest.mark.parametrize("verdict", ["sync", "deferred"])
def test_a_nan_step_changes_nothing_and_its_counters_roll_back(verdict):
    """skip_step: the bad step is reported in step() (sync) or at the next step() (deferred, no wait); either
    way it changed nothing, and the counters end as if it never was. Bit for bit the same parameters."""
    runs = {}
    for v in ("sync", verdict):
        model = make_model()
        opt = _opt(model, nonfinite="skip_step", verdict=v)
        reasons = []
        for step in range(1, 5):
            fill_grads(model, step)
            if step == 2:
                model.blocks[0].attn.weight.grad[0, 0] = float("nan")
            opt.step()
            reasons.append(opt.last_skip_reason)
            opt.last_skip_reason = None
        runs[v] = (params_of(model), reasons, [g["step"] for g in opt.param_groups])
    params, reasons, steps = runs[verdict]
    assert all(torch.equal(params[k], runs["sync"][0][k]) for k in params)
    assert steps == [3, 3]
    bad = 1 if verdict == "sync" else 2  # the step whose step() reports it
    assert [r is not None for r in reasons] == [i == bad for i in range(4)]
    assert reasons[bad].startswith("step 2: gradient of 'blocks.0.attn.weight' holds nan")


def test_a_deferred_error_is_raised_at_the_next_step_and_nothing_moves():
    model = make_model()
    opt = _opt(model)  # the default verdict is deferred; nonfinite='error'
    fill_grads(model, 1)
    opt.step()
    fill_grads(model, 2)
    model.lm_head.weight.grad[1, 2] = float("inf")
    opt.step()  # enqueued; the verdict is out
    before = params_of(model)
    fill_grads(model, 3)
    with pytest.raises(RuntimeError, match="step 2: gradient of 'lm_head.weight' holds inf"):
        opt.step()
    assert all(torch.equal(p, before[n]) for n, p in params_of(model).items())  # step 3 was not run
    assert [g["step"] for g in opt.param_groups] == [1, 1]
    opt.step()  # the gradients of step 3 again: it runs now
    assert [g["step"] for g in opt.param_groups] == [2, 2]


def test_the_scalers_found_inf_skips_on_the_device_and_is_reported():
    model = make_model()
    opt = _opt(model, verdict="deferred")
    fill_grads(model, 1)
    opt.step()
    before = params_of(model)
    opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(1.0)  # as GradScaler hands them over
    fill_grads(model, 2)
    opt.step()
    del opt.grad_scale, opt.found_inf
    assert opt._settle() == normuon.optim.FOUND_INF_REASON
    assert all(torch.equal(p, before[n]) for n, p in params_of(model).items())
    assert [g["step"] for g in opt.param_groups] == [1, 1]


def test_a_bf16_parameter_given_new_data_gets_its_master_from_it_on_the_device():
    """p.data = t: the next step reads the master from t (the device's refresh kernels). With lr 0 the step
    writes the master back rounded: t itself, where a stale master would write the old values."""
    model = make_model(dtype=torch.bfloat16)
    opt = _opt(model, lr=0.0, adamw_lr=0.0, weight_decay=0.0, adamw_weight_decay=0.0)
    fill_grads(model, 1)
    opt.step()
    new = {n: (torch.randn(p.shape) * 3).to(torch.bfloat16) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.data = new[n].clone()
    fill_grads(model, 2)
    opt.step()
    assert all(torch.equal(p.detach(), new[n]) for n, p in model.named_parameters())


def test_state_dicts_resume_the_cuda_path_exactly():
    whole, first = make_model(), make_model()
    a, b = _opt(whole, verdict="deferred"), _opt(first, verdict="deferred")
    for step in range(1, 3):
        for m, o in ((whole, a), (first, b)):
            fill_grads(m, step)
            o.step()
    saved = b.state_dict()
    resumed_model = make_model()
    resumed_model.load_state_dict(first.state_dict())
    c = _opt(resumed_model, verdict="deferred")
    c.load_state_dict(saved)
    for step in range(3, 5):
        for m, o in ((whole, a), (resumed_model, c)):
            fill_grads(m, step)
            o.step()
    assert all(torch.equal(p, q) for p, q in zip(params_of(whole).values(), params_of(resumed_model).values()))
    assert [g["step"] for g in c.param_groups] == [4, 4]


def test_the_newton_schulz_plan_fields_are_fixed():
    """The CUDA plan is made from the Newton-Schulz knobs: a group may not change them afterwards; the engine
    says so, and the optimizer changes nothing."""
    model = make_model()
    opt = _opt(model)
    fill_grads(model, 1)
    group = next(g for g in opt.param_groups if g["algorithm"] == "normuon")
    group["ns_algorithm"] = "gram"
    with pytest.raises(ValueError, match="ns_algorithm' was 'standard' when the optimizer was built"):
        opt.step()
    group["ns_algorithm"] = "standard"
    group["lr"] = 0.5 * group["lr"]  # what may change, does
    opt.step()
    assert math.isclose(opt.engine.native.hyper(0)["lr"], group["lr"])


def test_megatron_reports_a_nan_one_step_late_and_keeps_its_counters():
    """Megatron's halves on the CUDA path (their default verdict is deferred): a NaN step is skipped on the
    device, reported at the next step() as an error, and TE's group counters stay as they were; a split
    QKV's blocks are stepped where they lie in the fused tensor."""
    from normuon.megatron import MegatronAdamW, MegatronNorMuon

    torch.manual_seed(4)
    matrices = [torch.nn.Parameter(torch.randn(32, 16)) for _ in range(3)]
    matrices[0].is_qkv, matrices[0].qkv_split_shapes = True, [2, 1, 1]
    vectors = [torch.nn.Parameter(torch.randn(16)) for _ in range(2)]
    muon = MegatronNorMuon([{"params": matrices, "lr": 1e-2, "weight_decay": 0.1}], coefficient_type="simple",
                           split_qkv=True, _device_backend=emulated_cuda_backend())
    adam = MegatronAdamW([{"params": vectors, "lr": 1e-2, "weight_decay": 0.0}],
                         _device_backend=emulated_cuda_backend())

    def grads(nan=False):
        for p in matrices + vectors:
            p.grad = torch.randn_like(p)
        if nan:
            matrices[1].grad[0, 0] = float("nan")

    for _ in range(3):
        grads()
        muon.step()
        adam.step()
    assert muon.backend == adam.backend == "fast-cuda-emulated"
    assert muon.param_groups[0]["step"] == adam.param_groups[0]["step"] == 3
    before = [p.detach().clone() for p in matrices]
    grads(nan=True)
    muon.step()  # enqueued; the device skips it
    grads()
    with pytest.raises(RuntimeError, match="gradient of .* holds nan"):
        muon.step()  # the verdict of the step before, before this one is enqueued
    assert muon.param_groups[0]["step"] == 3
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, matrices))
    muon.step()
    assert muon.param_groups[0]["step"] == 4
    assert not all(torch.equal(a, b.detach()) for a, b in zip(before, matrices))


@pytest.mark.parametrize("path", ["cpu", "cuda-emulated"])
def test_state_dicts_read_masters_after_outside_writes(path):
    """Between steps the engine refreshes masters by its own rule (Engine::refresh_master, on the device by
    its kernels): p.data = t shows in the next state dict's master_param, while a parameter that still holds
    its master rounded keeps the master's low bits."""
    model = make_model(dtype=torch.bfloat16)
    kw = {} if path == "cpu" else dict(_device_backend=emulated_cuda_backend())
    opt = normuon.NorMuonAdamW(model.named_parameters(), **kw)
    fill_grads(model, 1)
    opt.step()

    def masters():
        sd = opt.state_dict()
        return {name: sd["state"][i]["master_param"] for g in sd["param_groups"] for i, name in zip(g["params"], g["param_names"])}

    kept = masters()
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in kept.values())  # low bits below bf16
    with torch.no_grad():
        model.lm_head.weight.copy_(model.lm_head.weight.clone())  # its version moves; the values are its master's
    new = (torch.randn(model.wte.weight.shape) * 3).to(torch.bfloat16)
    model.wte.weight.data = new.clone()
    now = masters()
    assert torch.equal(now["wte.weight"], new.float())
    assert torch.equal(now["lm_head.weight"], kept["lm_head.weight"])
