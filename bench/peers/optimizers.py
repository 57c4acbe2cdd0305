"""The Python peers: each steps the same model with the same hyper-parameters, NorMuon (or Muon) on the
matrices and AdamW on the rest, routed by the project's rule (spec section 2).

A peer's prepare(ctx) checks that it can run here (raising Skip with the reason if not) and returns
(make, notes); make(model) builds a fresh optimizer and returns (step, more_notes), step() being one
optimizer step as a user calls it."""
import importlib
import importlib.util
import os
import sys
import types
from dataclasses import dataclass
from typing import Callable

import torch

import normuon

# One set of hyper-parameters for every peer (official NorMuonWithAuxAdam defaults, spec sections 3-4).
NORMUON_HP = dict(lr=0.02, momentum=0.95, beta2=0.95, weight_decay=0.0)
ADAMW_HP = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)


class Skip(Exception):
    """The peer cannot run here; the message says why."""


@dataclass
class Context:
    device: torch.device
    official_path: str
    dion_src: str              # a folder holding microsoft/dion's package folder dion/
    threads: int = 0  # CPU: the fused backend's threads (0: its default); torch's are set by the caller


@dataclass
class Peer:
    name: str
    what: str                  # one line for --help and the report
    prepare: Callable
    slow: bool = False         # per-parameter: --slow-steps / --slow-warmup apply
    fp32_only: bool = False    # takes fp32 parameters only: gets fp32 copies of the model's values
    mutates_grads: bool = False  # writes into p.grad: the gradients are restored before each timed step
    external: bool = False     # runs in another process (cli_peer.py), not through prepare()
    f32_hint: str = ""         # added to the reason when it fails on fp32 parameters


def _adamw(params, ctx):
    """torch's AdamW on the non-matrix parameters: fused on CUDA (the fast torch path), default on the CPU."""
    fused = ctx.device.type == "cuda"
    return torch.optim.AdamW(params, **ADAMW_HP, **({"fused": True} if fused else {})), (
        [] if fused else ["AdamW fused=False on the CPU (torch's default path)"])


def _chain(*opts):
    def step():
        for opt in opts:
            opt.step()
    return step


def _prepare_official(ctx):
    path = ctx.official_path
    if not os.path.isfile(path):
        raise Skip(f"{path} not found (--official-normuon PATH: zichongli5/NorMuon's normuon.py)")
    spec = importlib.util.spec_from_file_location("official_normuon", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # its own imports may be missing here
        raise Skip(f"{path} does not import ({type(error).__name__}: {error})") from None
    cls = getattr(module, "SingleDeviceNorMuonWithAuxAdam", None)
    if cls is None:
        raise Skip(f"{path} has no SingleDeviceNorMuonWithAuxAdam")

    def make(model):
        opt = cls([dict(params=model.matrices(), use_muon=True, **NORMUON_HP),
                   dict(params=model.others(), use_muon=False, **ADAMW_HP)])
        return opt.step, []
    return make, ["state in the parameter dtype, per-parameter loop"]


def _prepare_torch_muon(ctx):
    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        raise Skip(f"torch {torch.__version__} has no torch.optim.Muon (added in torch 2.9)")

    def make(model):
        adamw, notes = _adamw(model.others(), ctx)
        # torch's defaults where they differ from ours would change the maths: weight_decay 0.1, lr 1e-3.
        opt = muon(model.matrices(), lr=NORMUON_HP["lr"], momentum=NORMUON_HP["momentum"], nesterov=True,
                   weight_decay=NORMUON_HP["weight_decay"], adjust_lr_fn=None)
        return _chain(opt, adamw), notes
    return make, ["Muon, not NorMuon (no second-moment normalisation); adjust_lr_fn=None ('original': "
                  "max(1, m/n)^0.5); state in the parameter dtype"]


def _prepare_emerging(ctx):
    try:
        import emerging_optimizers
        from emerging_optimizers.orthogonalized_optimizers import AdaptiveMuon
    except Exception as error:
        raise Skip(f"emerging_optimizers does not import ({type(error).__name__}: {error}; it needs Python >= 3.12 "
                   "and absl-py: pip install --no-deps .whl/emerging_optimizers-0.3.0-py3-none-any.whl)") from None

    def make(model):
        adamw, notes = _adamw(model.others(), ctx)
        # moment2_method="normuon" with the official shape factor (scale_mode="shape_scaling" = max(1, m/n)^0.5).
        opt = AdaptiveMuon(model.matrices(), lr=NORMUON_HP["lr"], momentum=NORMUON_HP["momentum"],
                           weight_decay=NORMUON_HP["weight_decay"], nesterov=True, weight_decay_method="decoupled",
                           fp32_matmul_prec="medium", coefficient_type="quintic", num_ns_steps=5,
                           scale_mode="shape_scaling", moment2_method="normuon", beta2=NORMUON_HP["beta2"],
                           eps=ADAMW_HP["eps"])
        return _chain(opt, adamw), notes
    return make, [f"emerging_optimizers {emerging_optimizers.__version__} AdaptiveMuon(moment2_method='normuon'): "
                  "statistics along the longer dimension, eps as a clamp (spec knobs reduce_axis=longer_dim, "
                  "eps_placement=clamp); fp32 parameters only (its newton_schulz refuses other dtypes)"]


def _import_dion_normuon(src):
    """dion/normuon.py (and the modules it imports) from src, without dion/__init__.py: that imports every
    dion optimizer, and only NorMuon's files are staged. A private package name keeps an installed dion apart."""
    folder = os.path.join(src, "dion")
    if not os.path.isfile(os.path.join(folder, "normuon.py")):
        raise Skip(f"{folder}/normuon.py not found (--dion-src PATH: a folder holding microsoft/dion's dion/)")
    # Afresh on every call (each preset): torch.compile's recompile limit counts per code object, and one
    # preset's shapes would use up what the next needs.
    for name in [n for n in sys.modules if n == "_peer_dion" or n.startswith("_peer_dion.")]:
        del sys.modules[name]
    package = types.ModuleType("_peer_dion")
    package.__path__ = [folder]
    sys.modules["_peer_dion"] = package
    try:
        return importlib.import_module("_peer_dion.normuon")
    except Exception as error:  # its own imports may be missing here
        raise Skip(f"{folder}/normuon.py does not import ({type(error).__name__}: {error})") from None


def _prepare_dion(ctx):
    module = _import_dion_normuon(ctx.dion_src)
    commit = "unknown commit"
    if os.path.isfile(os.path.join(ctx.dion_src, "COMMIT")):  # written when staged: which dion this is
        with open(os.path.join(ctx.dion_src, "COMMIT")) as f:
            commit = f.read().strip()[:12]

    def make(model):
        # The official shape factor max(1, rows/cols)^0.5: dion's "spectral_norm" (rows/cols)^0.5 on tall and
        # square matrices, no factor (None) on wide ones. Nesterov as the official (dion's momentum mu*M + G is
        # the official's lerp over 1 - mu: the same direction into Newton-Schulz). NorMuon's epsilon only
        # guards Newton-Schulz, so the AdamW group sets its own.
        tall = [p for p in model.matrices() if p.shape[-2] >= p.shape[-1]]
        wide = [p for p in model.matrices() if p.shape[-2] < p.shape[-1]]
        groups = [dict(params=tall, adjust_lr="spectral_norm"), dict(params=wide, adjust_lr=None),
                  dict(params=model.others(), algorithm="adamw", lr=ADAMW_HP["lr"], beta1=ADAMW_HP["betas"][0],
                       beta2=ADAMW_HP["betas"][1], epsilon=ADAMW_HP["eps"], weight_decay=ADAMW_HP["weight_decay"])]
        opt = module.NorMuon([g for g in groups if g["params"]], distributed_mesh=None, lr=NORMUON_HP["lr"],
                             mu=NORMUON_HP["momentum"], muon_beta2=NORMUON_HP["beta2"],
                             weight_decay=NORMUON_HP["weight_decay"], nesterov=True)
        return opt.step, []
    return make, [f"dion {commit} NorMuon, single device (distributed_mesh=None): one batched update per "
                  "matrix shape, torch.compile'd (the first steps compile: warm-up absorbs them); Newton-Schulz is "
                  "Polar Express in bf16 (dion's default; other coefficients, the same 5 iterations); "
                  "normalisation eps 1e-8 (official 1e-10); AdamW groups by dion itself (torch._fused_adamw_); "
                  "state in the parameter dtype"]


def _normuon_kwargs(model, backend, threads=0):
    return dict(threads=threads, lr=NORMUON_HP["lr"], momentum=NORMUON_HP["momentum"], beta2=NORMUON_HP["beta2"],
                weight_decay=NORMUON_HP["weight_decay"], adamw_lr=ADAMW_HP["lr"], adamw_betas=ADAMW_HP["betas"],
                adamw_eps=ADAMW_HP["eps"], adamw_weight_decay=ADAMW_HP["weight_decay"],
                roles={s.name: s.role for s in model.specs}, backend=backend)


def _prepare_normuon(backend, verdict="sync"):
    def prepare(ctx):
        if not normuon.native_available():
            raise Skip(f"normuon._C does not import ({normuon.native_error()}); build it and set PYTHONPATH")
        if backend == "reference" and ctx.device.type != "cpu":
            raise Skip("the reference steps CPU tensors (its bits are the same on every device): --device cpu")

        def make(model):
            opt = normuon.NorMuonAdamW(model.named(), verdict=verdict, **_normuon_kwargs(model, backend, ctx.threads))
            return opt.step, [f"backend {opt.backend}, verdict {verdict}"]
        return make, []
    return prepare


def _prepare_normuon_2d(ctx):
    if not normuon.native_available():
        raise Skip(f"normuon._C does not import ({normuon.native_error()}); build it and set PYTHONPATH")

    def make(model):
        """The banks' experts as 2-D parameters of their own: views of the banks (the same memory, the same
        gradients), so only the layout differs from fused-py's."""
        if not any(s.role == "experts" for s in model.specs):
            raise Skip("the model has no expert banks (--banks)")
        named, roles = [], {}
        for s, p in zip(model.specs, model.params):
            if s.role != "experts":
                named.append((s.name, p))
                roles[s.name] = s.role
                continue
            for k in range(p.shape[0]):
                expert = torch.nn.Parameter(p.detach()[k])
                expert.grad = p.grad[k]
                named.append((f"{s.name}[{k}]", expert))
                roles[f"{s.name}[{k}]"] = "matrix"
        kwargs = dict(_normuon_kwargs(model, "fast", ctx.threads), roles=roles)
        opt = normuon.NorMuonAdamW(named, **kwargs)
        return opt.step, [f"backend {opt.backend}; {len(named)} parameters, the banks' experts as views"]
    return make, []


PEERS = [
    Peer("official", "the official per-parameter NorMuon: SingleDeviceNorMuonWithAuxAdam from zichongli5/NorMuon's "
         "normuon.py (--official-normuon)", _prepare_official, slow=True, mutates_grads=True,
         f32_hint="known: its momentum and second moment are in the parameter dtype and its Newton-Schulz output "
                  "is bf16, so fp32 parameters fail in lerp_ (docs/spec.md section 3.5, upstream issue #7); "
                  "--param-dtype bf16 runs it"),
    Peer("torch-muon", "torch.optim.Muon on the matrices + torch.optim.AdamW(fused=True) on the rest",
         _prepare_torch_muon, slow=True),
    Peer("emerging-adaptive-muon", "NVIDIA emerging_optimizers AdaptiveMuon(moment2_method='normuon') on the "
         "matrices + torch.optim.AdamW(fused=True) on the rest", _prepare_emerging, slow=True, fp32_only=True),
    Peer("dion-normuon", "microsoft/dion's NorMuon (megabatched by shape, torch.compile'd) with its own AdamW "
         "groups (--dion-src)", _prepare_dion),
    Peer("reference", "this project's per-parameter reference, the spec's steps one parameter after another in C++: "
         "normuon.NorMuonAdamW(backend='reference'), CPU tensors only", _prepare_normuon("reference"), slow=True),
    Peer("fused-py", "this project's normuon.NorMuonAdamW(backend='fast', verdict='sync'): the fused CPU or CUDA "
         "backend, on CUDA one host sync per step for the NaN/Inf verdict", _prepare_normuon("fast")),
    Peer("fused-py-2d", "normuon.NorMuonAdamW(backend='fast') over the expert banks' experts as 2-D parameters "
         "of their own (views of the banks; with --banks only)", _prepare_normuon_2d),
    Peer("fused-py-deferred", "the same with verdict='deferred' (the default): on CUDA, a step's NaN/Inf verdict "
         "read at the next step, so no host sync per step", _prepare_normuon("fast", "deferred")),
    Peer("fused-cpp", "the C++ fused step through the tool: `normuon bench-cuda` (CUDA) or `normuon bench` (CPU)",
         None, external=True),
]
PEER_NAMES = [p.name for p in PEERS]
