"""NorMuonAdamW on CUDA tensors (the fast CUDA backend, device-resident state).

Everything but the first test needs a GPU, a CUDA build of torch and the native module built with the
CUDA backend; without them they are skipped with the reason (on the CPU machines: torch is CPU-only).
"""
import pytest

torch = pytest.importorskip("torch")
normuon = pytest.importorskip("normuon")
from normuon import optim  # noqa: E402


def _cuda_reason():
    if optim._C is None:
        return f"the native module is missing ({optim.native_error()})"
    if not torch.cuda.is_available():
        return "torch has no usable CUDA device (CPU-only torch or no GPU)"
    return optim.cuda_unavailable_reason(0) or None


needs_gpu = pytest.mark.skipif(_cuda_reason() is not None, reason=f"no GPU: {_cuda_reason()}")

# The CPU twins run on the fast CPU backend where _C has it, else on the reference: GPU machines build _C
# without oneDNN. Both are the spec to the last bit on AdamW, which is what the twins are held to.
CPU_BACKEND = "fast" if hasattr(optim._C, "FastCpuBackend") else "reference"


def _model(device, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential()
    model.add_module("embed", torch.nn.Embedding(37, 24))
    model.add_module("fc1", torch.nn.Linear(24, 64))
    model.add_module("fc2", torch.nn.Linear(64, 24))
    model.add_module("tall", torch.nn.Linear(24, 97, bias=False))
    model.add_module("head", torch.nn.Linear(24, 37, bias=False))
    return model.to(device=device, dtype=dtype)


def _grads(model, step):
    gen = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(device=p.device, dtype=p.dtype)


def test_parameters_on_an_unsupported_device_are_refused():
    p = torch.nn.Parameter(torch.zeros(4, 4, device="meta"))
    with pytest.raises(ValueError, match="CPU or CUDA"):
        normuon.NorMuonAdamW([("w", p)])


@needs_gpu
def test_cuda_matches_the_cpu():
    cpu, gpu = _model("cpu"), _model("cuda")
    opt_cpu = normuon.NorMuonAdamW(cpu.named_parameters(), weight_decay=0.1, adamw_weight_decay=0.01,
                                   backend=CPU_BACKEND)
    opt_gpu = normuon.NorMuonAdamW(gpu.named_parameters(), weight_decay=0.1, adamw_weight_decay=0.01)
    assert opt_gpu.backend == "fast-cuda"
    for step in range(1, 6):
        _grads(cpu, step)
        _grads(gpu, step)
        opt_cpu.step()
        opt_gpu.step()
    for (name, a), b in zip(cpu.named_parameters(), gpu.parameters()):
        b = b.detach().cpu()
        if name.startswith(("embed", "head")) or a.dim() == 1:  # AdamW: the same roundings, bit for bit
            assert torch.equal(a.detach(), b), name
        else:  # NorMuon: GEMMs differ; the update is small next to the parameter
            assert torch.allclose(a.detach(), b, rtol=0, atol=1e-3), name
    assert [g["step"] for g in opt_gpu.param_groups] == [5, 5]


@needs_gpu
def test_state_is_on_the_device_and_files_cross_to_the_cpu(tmp_path):
    gpu = _model("cuda")
    opt = normuon.NorMuonAdamW(gpu.named_parameters())
    for step in range(1, 4):
        _grads(gpu, step)
        opt.step()
    sd = opt.state_dict()
    assert all(t.is_cuda for s in sd["state"].values() for t in s.values())
    path = tmp_path / "gpu.safetensors"
    opt.export_state(path)
    cpu = _model("cpu", seed=1)
    opt_cpu = normuon.NorMuonAdamW(cpu.named_parameters(), backend=CPU_BACKEND)
    opt_cpu.import_state(path)
    for a, b in zip(gpu.parameters(), cpu.parameters()):
        assert torch.equal(a.detach().cpu(), b.detach())
    assert [g["step"] for g in opt_cpu.param_groups] == [3, 3]
    gpu_state, cpu_state = opt.state_dict()["state"], opt_cpu.state_dict()["state"]
    assert gpu_state.keys() == cpu_state.keys()
    for i in gpu_state:  # every state tensor crossed, not just the parameters
        assert gpu_state[i].keys() == cpu_state[i].keys()
        for k in gpu_state[i]:
            assert torch.equal(gpu_state[i][k].cpu(), cpu_state[i][k]), (i, k)
    # and back: the CPU optimizer's file loads on the GPU
    opt_cpu.export_state(path)
    opt.import_state(path)
    assert [g["step"] for g in opt.param_groups] == [3, 3]


@needs_gpu
def test_nan_gradient_raises_and_changes_nothing():
    gpu = _model("cuda")
    opt = normuon.NorMuonAdamW(gpu.named_parameters(), verdict="sync")  # raised in the bad step itself
    _grads(gpu, 1)
    opt.step()
    before = [p.detach().clone() for p in gpu.parameters()]
    _grads(gpu, 2)
    gpu.fc1.weight.grad[3, 5] = float("nan")
    with pytest.raises(RuntimeError, match="fc1.weight"):
        opt.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, gpu.parameters()))
    assert [g["step"] for g in opt.param_groups] == [1, 1]
    _grads(gpu, 3)  # the error is reported once; the next clean step runs
    opt.step()
    assert [g["step"] for g in opt.param_groups] == [2, 2]


@needs_gpu
def test_skip_step_and_missing_gradients_match_the_cpu():
    cpu, gpu = _model("cpu"), _model("cuda")
    opt_cpu = normuon.NorMuonAdamW(cpu.named_parameters(), nonfinite="skip_step", backend=CPU_BACKEND)
    opt_gpu = normuon.NorMuonAdamW(gpu.named_parameters(), nonfinite="skip_step", verdict="sync")  # step by step
    for step in range(1, 5):
        for model in (cpu, gpu):
            _grads(model, step)
            model.tall.weight.grad = None if step % 2 else model.tall.weight.grad  # no gradient: untouched
            if step == 3:
                model.head.weight.grad[0, 0] = float("inf")  # the whole step is skipped
        opt_cpu.step()
        opt_gpu.step()
        assert (opt_cpu.last_skip_reason is None) == (opt_gpu.last_skip_reason is None)
    assert opt_gpu.last_skip_reason is None
    for (name, a), b in zip(cpu.named_parameters(), gpu.parameters()):
        assert torch.allclose(a.detach(), b.detach().cpu(), rtol=0, atol=1e-3), name
    assert [g["step"] for g in opt_gpu.param_groups] == [g["step"] for g in opt_cpu.param_groups]


@needs_gpu
def test_load_state_dict_on_cuda_resumes_exactly():
    a, b = _model("cuda"), _model("cuda")
    opt_a = normuon.NorMuonAdamW(a.named_parameters())
    opt_b = normuon.NorMuonAdamW(b.named_parameters())
    for step in range(1, 3):
        _grads(a, step)
        opt_a.step()
    b.load_state_dict(a.state_dict())
    opt_b.load_state_dict(opt_a.state_dict())
    for step in range(3, 5):
        for model, opt in ((a, opt_a), (b, opt_b)):
            _grads(model, step)
            opt.step()
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x.detach(), y.detach())


@needs_gpu
def test_runs_on_the_current_stream():
    gpu = _model("cuda")
    reference_model = _model("cuda")
    opt = normuon.NorMuonAdamW(gpu.named_parameters())
    ref = normuon.NorMuonAdamW(reference_model.named_parameters())
    side = torch.cuda.Stream()
    for step in range(1, 4):
        _grads(reference_model, step)
        ref.step()
        with torch.cuda.stream(side):
            _grads(gpu, step)
            opt.step()
        torch.cuda.current_stream().wait_stream(side)
    for a, b in zip(gpu.parameters(), reference_model.parameters()):
        assert torch.equal(a.detach(), b.detach())


@needs_gpu
def test_bf16_parameters_keep_fp32_masters():
    gpu = _model("cuda", dtype=torch.bfloat16)
    opt = normuon.NorMuonAdamW(gpu.named_parameters())
    for step in range(1, 3):
        _grads(gpu, step)
        opt.step()
    sd = opt.state_dict()
    params = dict(gpu.named_parameters())
    checked = 0
    for g in sd["param_groups"]:  # state is numbered in param-group order, not model order
        for i, name in zip(g["params"], g["param_names"]):
            m = sd["state"][i]["master_param"]
            assert m.dtype == torch.float32 and m.is_cuda, name
            assert torch.equal(params[name].detach(), m.to(torch.bfloat16)), name
            checked += 1
    assert checked == len(params)


@needs_gpu
def test_default_steps_make_no_torch_sync():
    # The default verdict, 'deferred': step() binds addresses and enqueues; torch's sync debug mode raises on
    # any synchronising torch call (.item(), a pageable copy) made in it. bf16: masters, version counters.
    gpu = _model("cuda", dtype=torch.bfloat16)
    opt = normuon.NorMuonAdamW(gpu.named_parameters())
    _grads(gpu, 1)
    opt.step()  # the first step uploads the address table
    # The gradients are made on the device before the checked steps: made on the host, their copy to the
    # device is itself a synchronising (pageable) copy, and the check failed before the optimizer ran.
    grads = {}
    for step in range(2, 5):
        _grads(gpu, step)
        grads[step] = [p.grad for p in gpu.parameters()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(2, 5):
            for p, g in zip(gpu.parameters(), grads[step]):
                p.grad = g
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    opt.state_dict()  # settles the last verdict
    assert [g["step"] for g in opt.param_groups] == [4, 4] and opt.last_skip_reason is None


@needs_gpu
def test_megatron_split_qkv_runs_on_cuda_and_matches_the_cpu():
    # Megatron's default (split_qkv) crashed at the first CUDA step: the block row indices were CPU tensors.
    from normuon.megatron import MegatronAdamW, MegatronNorMuon

    def build(device):
        torch.manual_seed(3)
        qkv = torch.nn.Parameter(torch.randn(24, 16, device=device))
        qkv.is_qkv, qkv.qkv_split_shapes = True, [4, 1, 1]  # 4 query groups of (q, k, v) rows
        dense = torch.nn.Parameter(torch.randn(16, 32, device=device))
        bias = torch.nn.Parameter(torch.randn(16, device=device))
        backend = "fast" if device == "cuda" else CPU_BACKEND
        muon = MegatronNorMuon([{"params": [qkv, dense], "lr": 1e-2, "weight_decay": 0.1}], split_qkv=True,
                               coefficient_type="simple", fp32_matmul_prec="highest", backend=backend)
        adam = MegatronAdamW([{"params": [bias], "lr": 1e-2, "weight_decay": 0.0}], backend=backend)
        return [qkv, dense, bias], muon, adam

    cpu, gpu = build("cpu"), build("cuda")
    for step in range(1, 4):
        gen = torch.Generator().manual_seed(50 + step)
        grads = [torch.randn(p.shape, generator=gen) for p in cpu[0]]
        for params, muon, adam in (cpu, gpu):
            for p, g in zip(params, grads):
                p.grad = g.to(p.device)
            muon.step()
            adam.step()
    assert gpu[1].backend == gpu[2].backend == "fast-cuda"
    for a, b in zip(cpu[0], gpu[0]):
        assert torch.allclose(a.detach(), b.detach().cpu(), rtol=0, atol=1e-4)


@needs_gpu
def test_megatron_halves_add_no_torch_sync_and_a_nan_is_reported_one_step_late():
    from normuon.megatron import MegatronAdamW, MegatronNorMuon

    torch.manual_seed(4)
    matrices = [torch.nn.Parameter(torch.randn(32, 16, device="cuda")) for _ in range(3)]
    matrices[0].is_qkv, matrices[0].qkv_split_shapes = True, [2, 1, 1]  # split QKV: blocks stepped in place
    vectors = [torch.nn.Parameter(torch.randn(16, device="cuda")) for _ in range(2)]
    idle = torch.nn.Parameter(torch.randn(16, device="cuda"))  # never a gradient: TE's rule still counts
    muon = MegatronNorMuon([{"params": matrices, "lr": 1e-2, "weight_decay": 0.1}], coefficient_type="simple")
    adam = MegatronAdamW([{"params": vectors, "lr": 1e-2, "weight_decay": 0.0},
                          {"params": [idle], "lr": 1e-2, "weight_decay": 0.0}])

    def grads(nan=False):
        for p in matrices + vectors:
            p.grad = torch.randn_like(p)
        if nan:
            matrices[1].grad[0, 0] = float("nan")

    grads()
    muon.step()
    adam.step()  # the first steps upload the address tables
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            grads()
            muon.step()
            adam.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert muon.param_groups[0]["step"] == adam.param_groups[0]["step"] == adam.param_groups[1]["step"] == 4
    before = [p.detach().clone() for p in matrices]
    grads(nan=True)
    muon.step()  # enqueued; the device skips it
    grads()
    with pytest.raises(RuntimeError, match="gradient of .* holds nan"):
        muon.step()  # the verdict of the step before
    assert muon.param_groups[0]["step"] == 4
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, matrices))


@needs_gpu
@pytest.mark.parametrize("verdict", ["sync", "deferred"])
def test_grad_scaler_on_cuda_unscales_in_the_step_and_skips_on_inf(verdict):
    # GradScaler hands the fused CUDA step its scale and found_inf (device tensors): gradients are divided
    # as they are read, an inf step changes nothing, found_inf comes back through a pinned copy.
    cpu, gpu = _model("cpu"), _model("cuda")
    opt_cpu = normuon.NorMuonAdamW(cpu.named_parameters(), backend=CPU_BACKEND)
    opt_gpu = normuon.NorMuonAdamW(gpu.named_parameters(), verdict=verdict)
    assert opt_gpu._step_supports_amp_scaling
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12)
    scaler.scale(torch.ones((), device="cuda"))  # the scale tensor exists from the first scale() on
    for step in range(1, 6):
        _grads(cpu, step)
        _grads(gpu, step)
        for p in gpu.parameters():
            p.grad.mul_(scaler.get_scale())  # what backward of a scaled loss gives (a power of two: exact)
        if step == 3:
            gpu.fc1.weight.grad[0, 0] = float("inf")
        scaler.step(opt_gpu)
        scaler.update()
        if step != 3:
            opt_cpu.step()
    opt_gpu.state_dict()  # settles a deferred verdict
    assert [g["step"] for g in opt_gpu.param_groups] == [g["step"] for g in opt_cpu.param_groups] == [4, 4]
    for (name, a), b in zip(cpu.named_parameters(), gpu.parameters()):
        assert torch.allclose(a.detach(), b.detach().cpu(), rtol=0, atol=1e-3), name
