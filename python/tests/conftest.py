"""Shared pieces of the Python tests. Every test module starts with pytest.importorskip("torch"), so a
machine without torch reports the skip and its reason instead of failing."""
import os
import sys

import pytest

try:
    import torch
    from torch import nn
except ImportError:  # the test modules skip themselves
    torch = None


def require_native():
    """Skip (or, under CTest, fail) when normuon._C is not importable."""
    import normuon

    if normuon.native_available():
        return
    why = f"normuon._C is not importable ({normuon.native_error()}); build with cmake and set PYTHONPATH"
    if os.environ.get("NORMUON_PY_REQUIRE_NATIVE"):
        pytest.fail(why)
    pytest.skip(why)


def emulated_cuda_backend():
    """A device backend of normuon_emulated (tests/emulated_engine_module.cpp: the CUDA engine's backend, its
    device code on the SIMT emulator, over host memory), for NorMuonAdamW(..., _device_backend=...): the CUDA
    path without a GPU. Skips where the build has no CUDA toolkit (fails under CTest, which builds it)."""
    try:
        import normuon_emulated
    except ImportError as error:
        why = f"normuon_emulated is not importable ({error}): a build without the CUDA toolkit"
        if os.environ.get("NORMUON_PY_REQUIRE_EMULATED"):
            pytest.fail(why)
        pytest.skip(why)
    return normuon_emulated.engine_backend()


def torch_addcmul_fuses():
    """Whether torch's v.mul_(beta2).addcmul_(g, g, value=1 - beta2) rounds as the spec does, with one fma
    (its vectorised kernels); with ATEN_CPU_CAPABILITY=default it rounds twice. Only then can a state be
    compared bit for bit with torch.optim.AdamW's own."""
    import spec_oracle as spec

    g = torch.Generator().manual_seed(11)
    v, grad = torch.rand(1 << 12, generator=g), torch.randn(1 << 12, generator=g)
    ours = spec.fma(grad * spec.fp32(1 - 0.95), grad, v * spec.fp32(0.95))
    return torch.equal(v.clone().mul_(0.95).addcmul_(grad, grad, value=1 - 0.95), ours)


def torch_bf16_matmul_error():
    """Why torch cannot multiply bf16 matrices on this processor (torch 1.13 goes to oneDNN, which has no
    bf16 matmul below AVX-512, e.g. under ONEDNN_MAX_CPU_ISA=AVX2), or None. A bf16 model's forward needs it;
    normuon itself does not."""
    a = torch.ones(32, 32, dtype=torch.bfloat16)
    try:
        a @ a
    except RuntimeError as error:
        return f"torch {torch.__version__} has no bf16 matmul on this processor ({error})"
    return None


@pytest.fixture
def native():
    require_native()


@pytest.fixture(params=["fast", "reference"])
def backend(request):
    """Each test that takes `backend` runs on both backends; "fast" needs the native module."""
    if request.param == "fast":
        require_native()
    return request.param


def torch_sqrt_rounding_errors(n=1 << 16, seed=0):
    """Elements of a random fp32 vector whose torch.sqrt is not the correctly rounded square root (on some
    CPUs torch 2.x takes a vectorised sqrt that is off by an ulp on ~20% of the elements). The spec and the
    fast backends round every sqrt correctly, so bitwise agreement with torch.optim.AdamW needs 0 here."""
    x = torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 4
    return int((x.sqrt() != x.double().sqrt().float()).sum())


def require_exact_torch_sqrt():
    """Skips a bit-for-bit comparison with torch.optim.AdamW where torch's own kernels do not round as the
    spec does: its sqrt (not correctly rounded on some CPUs), or its addcmul_ (two roundings instead of the
    fma, with ATEN_CPU_CAPABILITY=default)."""
    wrong = torch_sqrt_rounding_errors()
    if wrong:
        pytest.skip(f"torch {torch.__version__}: torch.sqrt on this CPU rounds {wrong} of {1 << 16} values wrongly, "
                    "so no implementation with a correctly rounded sqrt (this one) can match torch.optim.AdamW bit "
                    "for bit here; the tolerance tests cover it")
    if not torch_addcmul_fuses():
        pytest.skip(f"torch {torch.__version__}: addcmul_ rounds twice here (ATen's capability without fma), so "
                    "torch.optim.AdamW's v differs from the spec's by rounding; the tolerance tests cover it")


def cli_path():
    """The `normuon` tool from the build (CTest passes NORMUON_CLI), or skip."""
    path = os.environ.get("NORMUON_CLI", "")
    if not path or not os.access(path, os.X_OK):
        pytest.skip("the normuon CLI is not available (set NORMUON_CLI=<build>/normuon)")
    return path


if torch is not None:

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.ln_1 = nn.LayerNorm(d)
            self.attn = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d, bias=False)
            self.ln_2 = nn.LayerNorm(d)
            self.mlp_fc = nn.Linear(d, 4 * d)
            self.mlp_proj = nn.Linear(4 * d, d)

        def forward(self, x):
            q, k, v = self.attn(self.ln_1(x)).chunk(3, dim=-1)
            w = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
            x = x + self.proj(w @ v)
            return x + self.mlp_proj(torch.relu(self.mlp_fc(self.ln_2(x))))

    class TinyGPT(nn.Module):
        """A GPT-like model: token and position embeddings, blocks, final norm, untied head."""

        def __init__(self, vocab=64, d=32, n_layer=2, ctx=16):
            super().__init__()
            self.wte = nn.Embedding(vocab, d)
            self.wpe = nn.Embedding(ctx, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(n_layer))
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, vocab, bias=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for b in self.blocks:
                x = b(x)
            return self.lm_head(self.ln_f(x))


def make_model(seed=0, dtype=None, **kw):
    torch.manual_seed(seed)
    model = TinyGPT(**kw)
    return model.to(dtype) if dtype is not None else model


def fill_grads(model, step, seed=7, skip=()):
    """Deterministic gradients with per-row gains (so NorMuon's row normalisation matters); parameters
    named in `skip` get none."""
    g = torch.Generator().manual_seed(seed * 1000003 + step)
    for name, p in model.named_parameters():
        if name in skip:
            p.grad = None
            continue
        grad = torch.randn(p.shape, generator=g)
        if p.dim() == 2:
            grad *= torch.logspace(-2, 2, p.shape[0], base=2.0).unsqueeze(1)
        p.grad = grad.to(p.dtype)


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def count_ops():
    """A TorchDispatchMode that records the ATen operators dispatched inside it (.ops)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    return CountOps()


def _gloo_rank(rank, job, world, out):
    """One spawned rank: a Gloo group through a FileStore in `out`, job(world, rank, out) saved there."""
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(out, f"store-w{world}"), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))  # a hang fails, not blocks
    try:
        torch.save(job(world, rank, out), os.path.join(out, f"w{world}-r{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's finalization: once FSDP is imported, torch keeps the group (and Gloo's worker
    # threads) past destroy_process_group, and a worker still dropping a finished collective's tensor while the
    # interpreter finalizes aborts the process (terminate called without an active exception).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_gloo_ranks(job, world, out):
    """job(world, rank, out) on `world` spawned processes over Gloo: what each rank returned, by rank. job
    must be a module-level function (the spawned processes import it)."""
    import torch.multiprocessing as mp

    mp.start_processes(_gloo_rank, args=(job, world, out), nprocs=world, join=True, start_method="spawn")
    return [torch.load(os.path.join(out, f"w{world}-r{r}.pt")) for r in range(world)]
