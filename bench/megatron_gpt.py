#!/usr/bin/env python3
"""A real Megatron-LM (megatron-core) training run of this project's optimizer next to Megatron's Adam.

One GPU, world size 1. It builds a small GPTModel with Megatron's local layer spec (no Transformer
Engine, no Apex), in bf16, wrapped in Megatron's Float16Module and DistributedDataParallel; builds the
optimizer with Megatron's own get_megatron_optimizer(); trains with Megatron's own forward/backward
schedule (get_forward_backward_func, finalize_model_grads) and the steps of Megatron's train_step
(zero_grad_buffer, zero_grad, forward-backward, optimizer.step() inside the 'optimizer' timer, the
OptimizerParamScheduler step); saves a checkpoint at --resume-at as Megatron's checkpointing does
(format 'torch' and 'torch_dist'), keeps going to --iters, then resumes fresh copies from the checkpoint
and checks that losses, parameters and optimizer state are bit for bit those of the uninterrupted run.

Optimizer variants (--optimizers):
  adam             Megatron's Adam as Megatron picks it (TE FusedAdam, Apex FusedAdam, else torch.optim.AdamW)
  normuon          normuon.megatron.register('normuon', replace_adam=True);
                   OptimizerConfig(optimizer='normuon', muon_coefficient_type='simple'):
                   MegatronNorMuon on the hidden matrices, MegatronAdamW on the rest
  normuon-stock    the route for the stock pretrain_gpt.py: register('adaptive_muon', replace_existing=True,
                   replace_adam=True); OptimizerConfig(optimizer='adaptive_muon', ...)
  normuon-nosplit  normuon with muon_split_qkv=False (QKV orthogonalised whole)
  adamw            normuon.megatron.replace_adam() only; optimizer='adam' builds MegatronAdamW everywhere
  mcore-normuon    Megatron's own TensorParallelAdaptiveMuon with moment2_method='normuon' and the 'simple'
                   coefficients (needs the emerging_optimizers package), for comparison
A normuon variant may name its backend: normuon-nosplit@reference (default: --backend, else fast).
Each variant runs with --distributed-optimizer off and/or on. 'on' means Megatron's DistributedOptimizer
for Adam (+distopt), and for the emerging-optimizer variants what --use-distributed-optimizer means there,
the LayerWiseDistributedOptimizer (whole matrices per rank), in one or both of Megatron's two set-ups
(--layer-wise): +layerwise, the legacy ping-pong path that pretrain_gpt.py builds in megatron-core 0.19
(every parameter in LayerWise, DDP without the distributed optimizer), and +layerwise-layout, LayerWise for
the matrices plus a DistributedOptimizer for the Adam groups over DDP's layer-wise parameter layout (as
megatron.training.training.wrap_model_chunks_with_ddp sets it up). With one process nothing is actually
sharded: these runs exercise Megatron's code paths and checkpoint formats, not their communication.

Each run happens in its own process (--isolate, the default): a crash or a hang costs that run only, and
--time-budget (default 540 s) stops what would overrun, so the report always comes out.

Only the last 12,000 characters of output may come back from a remote run, so the report is printed
last; --json and --markdown write everything (atomically).

--device cpu is a dry run for machines without a GPU: Megatron hard-codes CUDA in many places
(device='cuda' tensors, torch.cuda.current_device(), 'torch.cuda.*Tensor' type checks, CUDA RNG
states), so the script redirects those to the CPU with a torch function mode and stand-ins for a few
torch.cuda functions, and uses gloo. The numbers of a CPU dry run say nothing about GPU speed.

Some failures belong to Megatron itself and are reported as "n/a (Megatron limitation)", not as failures:
the report names them (megatron-core 0.19 without TE/Apex: DistributedOptimizer over torch.optim.AdamW
cannot resume; ckpt-format 'torch' with the layer-wise optimizer calls a method its ChainedOptimizer lacks;
Megatron's own adaptive_muon cannot step with emerging_optimizers 0.3). Nothing else is excused.

--pretrain-gpt prints (with --run-pretrain-gpt also runs) a command for the stock pretrain_gpt.py
--mock-data with this script's tiny sizes, through bench/megatron_pretrain_gpt.py, which registers normuon
as 'adaptive_muon' first.

Exit status: 0 when every run completed with bit-exact resumes (Megatron's own limitations aside) and at
least one did, 1 otherwise, 2 when the setup is missing (megatron-core or normuon not importable, no GPU
for --device cuda).
"""
import argparse
import collections
import contextlib
import dataclasses
import datetime
import functools
import gc
import importlib
import json
import logging
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings

from peers.files import write_atomic  # bench/ is sys.path[0]: this script runs as bench/megatron_gpt.py

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VARIANTS = {
    "adam": "Megatron's Adam as Megatron picks it (TE/Apex FusedAdam, else torch.optim.AdamW)",
    "normuon": "register('normuon', replace_adam=True); optimizer='normuon', muon_coefficient_type='simple'",
    "normuon-stock": "register('adaptive_muon', replace_existing=True, replace_adam=True); optimizer='adaptive_muon' "
                     "(the stock pretrain_gpt.py route)",
    "normuon-nosplit": "as normuon, with muon_split_qkv=False",
    "adamw": "replace_adam() only; optimizer='adam' builds normuon's MegatronAdamW",
    "mcore-normuon": "Megatron's own adaptive_muon (TensorParallelAdaptiveMuon) with moment2_method='normuon', "
                     "coefficients 'simple' (needs emerging_optimizers)",
}
EMERGING = {"normuon", "normuon-stock", "normuon-nosplit", "mcore-normuon"}
OURS = {"normuon", "normuon-stock", "normuon-nosplit", "adamw"}  # these take a normuon backend: NAME@BACKEND
BACKENDS = ("auto", "fast", "reference")


# How a run distributes the optimizer (one process, so "distributed" means Megatron's code paths, not sharding):
MODES = {
    "off": ("", "", "no distributed optimizer"),
    "distopt": ("+distopt", "+do", "DistributedOptimizer (use_distributed_optimizer) with DDP's parameter layout"),
    "layerwise": ("+layerwise", "+lw", "LayerWiseDistributedOptimizer, legacy ping-pong path (every parameter in it, DDP "
                  "without the distributed optimizer): what pretrain_gpt.py --use-distributed-optimizer builds in "
                  "megatron-core 0.19"),
    "layerwise-layout": ("+layerwise-layout", "+lwl", "LayerWiseDistributedOptimizer for the matrices + "
                         "DistributedOptimizer for the Adam groups over DDP's layer-wise parameter layout "
                         "(megatron.training.training.wrap_model_chunks_with_ddp)"),
}


def run_plan(args):
    """The (variant spec, mode) pairs to run, in order."""
    plan = []
    for spec in args.variants:
        name, _ = split_spec(spec)
        for distopt in args.distopt:
            if not distopt:
                plan.append((spec, "off"))
            elif name in EMERGING:
                plan += [(spec, m) for m in {"ping-pong": ["layerwise"], "layout": ["layerwise-layout"],
                                             "both": ["layerwise", "layerwise-layout"]}[args.layer_wise]]
            else:
                plan.append((spec, "distopt"))
    return plan


def split_spec(spec):
    """'normuon-nosplit@reference' -> ('normuon-nosplit', 'reference'); 'adam' -> ('adam', None)."""
    name, _, backend = spec.partition("@")
    return name, (backend or None)
FORMATS = ("torch", "torch_dist")
# The timers Megatron's optimizers start inside step() (optimizer.py), and the one train_step puts around it.
OPTIMIZER_TIMERS = ("optimizer", "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf",
                    "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
                    "optimizer-copy-main-to-model-params", "params-all-gather", "forward-backward")

log = logging.getLogger("megatron_gpt")


def new_record(spec, mode):
    """A run's record before it runs."""
    name, backend = split_spec(spec)
    return {"label": spec + MODES[mode][0], "variant": name, "backend": backend, "mode": mode,
            "distributed_optimizer": mode != "off",
            "what": VARIANTS[name] + ("" if mode == "off" else "; " + MODES[mode][2]),
            "iterations": [], "errors": [], "resume": {}}


def reraise_interrupts(error):
    """Re-raises Ctrl-C and exits (KeyboardInterrupt, SystemExit, GeneratorExit); returns for anything else.
    A run catches BaseException to record and survive every error, including BaseExceptions that are errors in
    disguise (torch.distributed.checkpoint's CheckpointException derives from BaseException), and calls this
    first so that an interrupt or an exit still stops it."""
    if isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        raise error


# ----------------------------------------------------------------------------------------------- arguments

def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="bench/megatron_gpt.py",
        description=__doc__.split("\n\n")[0] + " See the module docstring (or --help-long) for the details.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""setup on the GPU machine (Python 3.12, no network):
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD/build-gpu/python
  python3 bench/megatron_gpt.py --optimizers adam,normuon --json out.json --markdown out.md
without megatron-core installed, --megatron-path (default: .megatron-lm when importing megatron fails) points
at a Megatron-LM source tree; megatron-core 0.18-0.20 is what normuon.megatron knows.""")
    p.add_argument("--help-long", action="store_true", help="print the module docstring and exit")
    p.add_argument("--iters", type=int, default=20, help="training iterations (default 20)")
    p.add_argument("--resume-at", type=int, default=10,
                   help="save the checkpoint after this iteration and resume from it (default 10; 0: no resume test)")
    p.add_argument("--optimizers", default="adam,normuon",
                   help=f"comma list of variants (default adam,normuon): {', '.join(VARIANTS)}; a normuon variant "
                        "may name its backend, e.g. normuon-nosplit@reference (default: --backend)")
    p.add_argument("--distributed-optimizer", default="both", choices=("off", "on", "both"),
                   help="use_distributed_optimizer off, on, or both (default both; for the emerging-optimizer variants "
                        "'on' is the layer-wise distributed optimizer)")
    p.add_argument("--layer-wise", default="both", choices=("ping-pong", "layout", "both"),
                   help="for the emerging-optimizer variants with --distributed-optimizer on: LayerWise's legacy "
                        "ping-pong path (what pretrain_gpt.py builds in 0.19), the one over DDP's layer-wise parameter "
                        "layout with a DistributedOptimizer for the Adam groups (megatron.training's "
                        "wrap_model_chunks_with_ddp), or both (default)")
    p.add_argument("--ckpt-formats", default="torch,torch_dist",
                   help="checkpoint formats to save and resume from: torch (state_dict + torch.save, as Megatron's "
                        "'torch' format), torch_dist (sharded_state_dict + dist_checkpointing); default both")
    p.add_argument("--no-determinism-check", action="store_true",
                   help="skip the second uninterrupted run that tells nondeterminism apart from resume errors")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (NCCL) or cpu (gloo, a dry run with Megatron's CUDA calls redirected); default cuda")
    p.add_argument("--dist-backend", choices=("nccl", "gloo"), default=None,
                   help="torch.distributed backend (default: nccl on cuda, gloo on cpu)")
    p.add_argument("--megatron-path", default=None,
                   help="a Megatron-LM source tree to import megatron from (default: only when importing megatron "
                        "fails, REPO/.megatron-lm)")
    p.add_argument("--normuon-path", default=None,
                   help="where the normuon package is (default: importable as is, else REPO/build-gpu/python, "
                        "REPO/build/python)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every number to FILE (JSON)")
    p.add_argument("--markdown", default=None, metavar="FILE", help="write the report to FILE (Markdown)")
    # model
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--num-query-groups", type=int, default=2, help="GQA groups (default 2; = heads for MHA)")
    p.add_argument("--ffn-hidden-size", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--data", choices=("markov", "uniform"), default="markov",
                   help="synthetic tokens: markov (a fixed random next-token map, followed 90%% of the time; "
                        "learnable) or uniform (nothing to learn); default markov")
    p.add_argument("--seed", type=int, default=1234)
    # optimizer
    p.add_argument("--lr", type=float, default=3e-4, help="max lr (default 3e-4)")
    p.add_argument("--min-lr", type=float, default=3e-5)
    p.add_argument("--lr-warmup-iters", type=int, default=2)
    p.add_argument("--lr-decay-style", default="cosine", help="OptimizerParamScheduler decay style (or 'constant')")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--set", dest="config_set", action="append", default=[], metavar="FIELD=VALUE",
                   help="set an OptimizerConfig field for every variant (repeatable), e.g. --set muon_nesterov=true")
    p.add_argument("--backend", default=None,
                   help="normuon backend for the normuon variants (default: NORMUON_BACKEND, else auto = fast)")
    p.add_argument("--no-deterministic", action="store_true",
                   help="do not call torch.use_deterministic_algorithms(True, warn_only=True)")
    p.add_argument("--verbose", action="store_true", help="Megatron's INFO logs too")
    p.add_argument("--isolate", dest="isolate", action="store_true", default=True,
                   help="run each (variant, distributed optimizer) in its own process (the default): a crash or a hang "
                        "loses that run only, and the report still comes out")
    p.add_argument("--no-isolate", dest="isolate", action="store_false", help="every run in this process")
    p.add_argument("--time-budget", type=float, default=540.0,
                   help="seconds for all runs (default 540, under a 600 s command limit): with --isolate, a run that "
                        "would overrun is stopped and the ones left are skipped, and the report still comes out")
    p.add_argument("--child-run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    # the stock pretrain_gpt.py
    p.add_argument("--pretrain-gpt", action="store_true",
                   help="instead of the runs above, print (and with --run-pretrain-gpt run) a command for the stock "
                        "pretrain_gpt.py --mock-data with tiny sizes through bench/megatron_pretrain_gpt.py, which "
                        "registers normuon as 'adaptive_muon' first")
    p.add_argument("--run-pretrain-gpt", action="store_true", help="with --pretrain-gpt: run the command too")
    p.add_argument("--pretrain-arg", action="append", default=[], metavar="ARG",
                   help="with --pretrain-gpt: one more pretrain_gpt.py argument (repeatable; write --pretrain-arg=--flag), "
                        "e.g. --pretrain-arg=--muon-no-split-qkv or --pretrain-arg=--use-distributed-optimizer")
    args = p.parse_args(argv)
    if args.help_long:
        print(__doc__)
        sys.exit(0)
    args.variants = [v.strip() for v in args.optimizers.split(",") if v.strip()]
    unknown = [v for v in args.variants if split_spec(v)[0] not in VARIANTS]
    if unknown or not args.variants:
        p.error(f"--optimizers: unknown {unknown or 'empty list'}; choose from {', '.join(VARIANTS)}")
    for v in args.variants:
        name, backend = split_spec(v)
        if backend is not None and (name not in OURS or backend not in BACKENDS):
            p.error(f"--optimizers: {v}: only {', '.join(sorted(OURS))} take @BACKEND, one of {', '.join(BACKENDS)}")
    args.formats = [f.strip() for f in args.ckpt_formats.split(",") if f.strip()]
    bad = [f for f in args.formats if f not in FORMATS]
    if bad:
        p.error(f"--ckpt-formats: unknown {bad}; choose from {', '.join(FORMATS)}")
    if args.iters < 1:
        p.error("--iters must be >= 1")
    if not 0 <= args.lr_warmup_iters < args.iters:  # Megatron's scheduler asserts warm-up < decay (= --iters)
        p.error(f"--lr-warmup-iters must be in [0, --iters - 1] = [0, {args.iters - 1}]")
    if args.resume_at < 0 or args.resume_at >= args.iters:
        if args.resume_at != 0:
            p.error(f"--resume-at must be in [1, --iters - 1] = [1, {args.iters - 1}], or 0 for no resume test")
    if args.hidden_size % args.num_attention_heads or args.num_attention_heads % args.num_query_groups:
        p.error("--hidden-size must be a multiple of --num-attention-heads, which must be a multiple of "
                "--num-query-groups")
    args.distopt = {"off": [False], "on": [True], "both": [False, True]}[args.distributed_optimizer]
    return args


def fail_setup(message):
    print(f"megatron_gpt.py: {message}", file=sys.stderr)
    sys.exit(2)


# ----------------------------------------------------------------------------------------------- imports

def import_first(package, candidates, load):
    """load() with the environment's sys.path (candidate None), else with each candidate folder holding
    `package` put first on sys.path (and `package`'s modules dropped, so they load from there), until one
    works; a folder that failed is taken off sys.path again. Returns (load's result, the folder or None for
    the environment, tried), or (None, None, tried); `tried` says why each candidate failed."""
    tried = []
    for path in candidates:
        if path is not None:
            if not os.path.isdir(os.path.join(path, *package.split("."))):
                tried.append(f"{path}: no {package.replace('.', '/')} there")
                continue
            sys.path.insert(0, os.path.abspath(path))
            top = package.split(".")[0]
            for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
                del sys.modules[name]
        try:
            return load(), path, tried
        except Exception as error:  # noqa: BLE001 - ImportError, or a broken install: say which
            tried.append(f"{path or 'the environment (PYTHONPATH)'}: {type(error).__name__}: {error}")
            if path is not None:
                sys.path.remove(os.path.abspath(path))
    return None, None, tried


def import_megatron(args):
    """megatron.core from the environment, else from --megatron-path / REPO/.megatron-lm; exit 2 otherwise."""
    os.environ.setdefault("NO_VCS_VERSION", "1")  # the source tree's package_info would run git in its folder

    def load():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            core = importlib.import_module("megatron.core")
            importlib.import_module("megatron.core.optimizer")
            importlib.import_module("megatron.core.models.gpt")
            importlib.import_module("megatron.core.distributed")
        captured = sorted({str(w.message) for w in caught if str(w.message).startswith(
            ("Transformer Engine and Apex are not installed", "Apex is not installed"))})
        return core, captured

    paths = [args.megatron_path] if args.megatron_path else [None, os.path.join(REPO, ".megatron-lm")]
    loaded, path, tried = import_first("megatron.core", paths, load)
    if loaded is not None:
        core, captured = loaded
        return core, (path or "environment"), captured
    fail_setup("megatron-core is not importable:\n  " + "\n  ".join(tried) + "\n"
               "Install it (megatron-core 0.18-0.20; the wheels need Python 3.12), e.g. from the wheels carried in .whl:\n"
               "  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
               "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site\n"
               "or carry a Megatron-LM source tree and pass --megatron-path DIR (pure Python: megatron/core needs only "
               "torch, numpy and packaging).")


def import_normuon(args):
    def load():
        normuon = importlib.import_module("normuon")
        nm = importlib.import_module("normuon.megatron")
        native = normuon.optim.native_error() if hasattr(normuon, "optim") else None
        if native is not None:
            raise ImportError(f"normuon._C: {native}")
        return normuon, nm, os.path.dirname(os.path.dirname(os.path.abspath(normuon.__file__)))

    candidates = [args.normuon_path] if args.normuon_path else [None, os.path.join(REPO, "build-gpu", "python"),
                                                                os.path.join(REPO, "build", "python")]
    loaded, _, tried = import_first("normuon", candidates, load)
    if loaded is not None:
        return loaded
    fail_setup("the normuon package (with its native module normuon._C) is not importable:\n  " + "\n  ".join(tried)
               + "\nBuild it (cmake, e.g. scripts/gpu-test.sh --build-only puts it in build-gpu/python) and put its "
                 "folder on PYTHONPATH or pass --normuon-path.")


# ----------------------------------------------------------------------------------------------- CPU dry run

class CpuDryRun:
    """Runs Megatron's CUDA-only code on the CPU: a torch function mode turns device='cuda' (and integer
    devices), .cuda() and .to('cuda') into the CPU, makes Tensor.type() answer 'torch.cuda.*Tensor' (Megatron's
    mixed-precision wrappers check it), and a few torch.cuda functions get stand-ins (current_device,
    current_stream, Stream, Event, stream, synchronize, device_count, empty_cache, memory counters). CUDA RNG
    states are not emulated: use model_parallel_cuda_manual_seed(..., inference_rng_tracker=True), whose tracker
    does not fork."""

    class _Stream:
        cuda_stream = 0

        def __init__(self, *a, **k):
            pass

        def wait_stream(self, *a, **k):
            pass

        def wait_event(self, *a, **k):
            pass

        def synchronize(self):
            pass

        def record_event(self, *a, **k):
            return CpuDryRun._Event()

    class _Event:
        def __init__(self, *a, **k):
            self.t = None

        def record(self, *a, **k):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def wait(self, *a, **k):
            pass

        def query(self):
            return True

        def elapsed_time(self, end):
            return 1000.0 * ((end.t or 0.0) - (self.t or 0.0))

    def __init__(self, claim_cuda_available=False):
        import torch
        from torch.overrides import TorchFunctionMode

        self.torch = torch

        def cpu(dev):
            if isinstance(dev, bool):
                return dev
            if isinstance(dev, int):
                return torch.device("cpu")
            if isinstance(dev, str) and dev.startswith("cuda"):
                return torch.device("cpu")
            if isinstance(dev, torch.device) and dev.type == "cuda":
                return torch.device("cpu")
            return dev

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = dict(kwargs or {})
                if "device" in kwargs:
                    kwargs["device"] = cpu(kwargs["device"])
                name = getattr(func, "__name__", "")
                if name in ("cuda", "pin_memory"):
                    return args[0]
                if name == "to" and len(args) > 1 and isinstance(args[1], (str, torch.device, int)):
                    args = (args[0], cpu(args[1])) + tuple(args[2:])
                out = func(*args, **kwargs)
                if (name == "type" and len(args) == 1 and not kwargs and isinstance(out, str)
                        and out.startswith("torch.") and ".cuda." not in out):
                    out = "torch.cuda." + out[len("torch."):]
                return out

        self.mode = Mode()
        self.patches = dict(current_device=lambda: 0, current_stream=lambda *a, **k: CpuDryRun._Stream(),
                            default_stream=lambda *a, **k: CpuDryRun._Stream(), Stream=CpuDryRun._Stream,
                            Event=CpuDryRun._Event, stream=lambda *a, **k: contextlib.nullcontext(),
                            synchronize=lambda *a, **k: None, device_count=lambda: 1, empty_cache=lambda: None,
                            memory_allocated=lambda *a, **k: 0, max_memory_allocated=lambda *a, **k: 0,
                            reset_peak_memory_stats=lambda *a, **k: None, set_device=lambda *a, **k: None,
                            get_rng_state=lambda *a, **k: torch.get_rng_state(),
                            set_rng_state=lambda state, *a, **k: torch.set_rng_state(state))
        if claim_cuda_available:  # megatron.training's initialize asserts it
            self.patches["is_available"] = lambda: True
        self.saved = {}

    def __enter__(self):
        import torch.cuda.random

        for k, v in self.patches.items():
            for module in (self.torch.cuda, torch.cuda.random):
                if module is self.torch.cuda or hasattr(module, k):
                    self.saved[(module, k)] = getattr(module, k, None)
                    setattr(module, k, v)
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        for (module, k), v in self.saved.items():
            setattr(module, k, v)
        return False


# ----------------------------------------------------------------------------------------------- helpers

def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def qualname(obj):
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def optimizer_tree(optimizer):
    """ChainedOptimizer[LayerWiseDistributedOptimizer[Float16OptimizerWithFloat16Params(MegatronNorMuon)], ...]:
    Megatron's wrappers and the torch optimizers inside (bench/megatron_pretrain_gpt.py prints it too)."""
    name = type(optimizer).__name__
    if hasattr(optimizer, "chained_optimizers"):
        return f"{name}[{', '.join(optimizer_tree(o) for o in optimizer.chained_optimizers)}]"
    inner = getattr(optimizer, "optimizer", None)
    return f"{name}({qualname(inner) if inner is not None else 'None'})"


def parse_value(field, text):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def median(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else None


def fmt(x, spec=".4f"):
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


# ----------------------------------------------------------------------------------------------- the bench

class Bench:
    def __init__(self, args, megatron_core, megatron_source, import_warnings, normuon, nm, normuon_path):
        import torch

        self.args, self.torch, self.normuon, self.nm = args, torch, normuon, nm
        self.megatron_source, self.import_warnings, self.normuon_path = megatron_source, import_warnings, normuon_path
        self.mc = megatron_core
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core import dist_checkpointing
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.timers import Timers
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.module import Float16Module

        self.m = dict(parallel_state=parallel_state, tensor_parallel=tensor_parallel,
                      dist_checkpointing=dist_checkpointing, DDP=DistributedDataParallel,
                      DDPConfig=DistributedDataParallelConfig, finalize_model_grads=finalize_model_grads,
                      GPTModel=GPTModel, local_spec=get_gpt_layer_local_spec, OptimizerConfig=OptimizerConfig,
                      get_megatron_optimizer=get_megatron_optimizer, Scheduler=OptimizerParamScheduler,
                      get_forward_backward_func=get_forward_backward_func, Timers=Timers,
                      TransformerConfig=TransformerConfig, Float16Module=Float16Module)
        self.mopt = importlib.import_module("megatron.core.optimizer")
        self.eo = importlib.import_module("megatron.core.optimizer.emerging_optimizers")
        self.device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
        self.results = {"runs": [], "setup": {}}
        self.batches = None
        self.workdir = tempfile.mkdtemp(prefix="megatron_gpt-")

    # ------------------------------------------------------------------ distributed, seeds, data

    def init_distributed(self):
        torch, args = self.torch, self.args
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        if args.device == "cuda":
            torch.cuda.set_device(0)
        backend = args.dist_backend or ("nccl" if args.device == "cuda" else "gloo")
        torch.distributed.init_process_group(backend, init_method="env://", rank=0, world_size=1)
        self.m["parallel_state"].initialize_model_parallel(1, 1)
        self.results["setup"]["process_group_backend"] = backend

    def seed(self):
        torch = self.torch
        torch.manual_seed(self.args.seed)
        # force_reset: a fresh tracker per model, so every build (and every variant) starts from the same weights
        seed = self.m["tensor_parallel"].model_parallel_cuda_manual_seed
        try:
            seed(self.args.seed, inference_rng_tracker=self.args.device == "cpu", force_reset_rng=True)
        except TypeError:  # a megatron-core without force_reset_rng: reset() inside still clears the states
            seed(self.args.seed, inference_rng_tracker=self.args.device == "cpu")

    def make_batches(self):
        """The same fixed token batches for every run: [iters] of (tokens, labels, loss_mask, position_ids)."""
        torch, a = self.torch, self.args
        g = torch.Generator().manual_seed(a.seed + 1)
        n, b, s, v = a.iters, a.micro_batch_size, a.seq_length, a.vocab_size
        if a.data == "uniform":
            seq = torch.randint(0, v, (n, b, s + 1), generator=g)
        else:
            nxt = torch.randperm(v, generator=g)
            seq = torch.empty((n, b, s + 1), dtype=torch.long)
            seq[:, :, 0] = torch.randint(0, v, (n, b), generator=g)
            follow = torch.rand((n, b, s), generator=g) < 0.9
            noise = torch.randint(0, v, (n, b, s), generator=g)
            for t in range(s):
                seq[:, :, t + 1] = torch.where(follow[:, :, t], nxt[seq[:, :, t]], noise[:, :, t])
        self.batches = []
        for i in range(n):
            tokens = seq[i, :, :-1].contiguous()
            labels = seq[i, :, 1:].contiguous()
            self.batches.append(dict(tokens=tokens, labels=labels, loss_mask=torch.ones((b, s), dtype=torch.float),
                                     position_ids=torch.arange(s).unsqueeze(0).expand(b, s).contiguous()))

    # ------------------------------------------------------------------ variants

    @contextlib.contextmanager
    def megatron_globals(self):
        """register()/replace_adam() set module globals of megatron.core.optimizer; restore them afterwards so
        every variant starts from Megatron as it was imported."""
        mopt, eo = self.mopt, self.eo
        saved = {k: getattr(mopt, k) for k in ("Adam", "USING_PYTORCH_OPTIMIZER", "HAVE_EMERGING_OPTIMIZERS")
                 if hasattr(mopt, k)}
        registry = dict(eo._EMERGING_OPTIMIZERS)
        try:
            yield
        finally:
            for k, v in saved.items():
                setattr(mopt, k, v)
            eo._EMERGING_OPTIMIZERS.clear()
            eo._EMERGING_OPTIMIZERS.update(registry)

    def optimizer_config(self, variant, mode, timers):
        a = self.args
        cfg = dict(lr=a.lr, min_lr=a.min_lr, weight_decay=a.weight_decay, bf16=True, params_dtype=self.torch.bfloat16,
                   adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=a.clip_grad, timers=timers,
                   muon_coefficient_type="simple")
        if variant in EMERGING:
            cfg["optimizer"] = {"normuon": "normuon", "normuon-nosplit": "normuon"}.get(variant, "adaptive_muon")
            cfg["use_layer_wise_distributed_optimizer"] = mode in ("layerwise", "layerwise-layout")
            cfg["use_distributed_optimizer"] = False  # what megatron.training's arguments do for emerging optimizers
        else:
            cfg["optimizer"] = "adam"
            cfg["use_distributed_optimizer"] = mode == "distopt"
        if variant == "normuon-nosplit":
            cfg["muon_split_qkv"] = False
        if variant == "mcore-normuon":
            cfg["adaptive_muon_moment2_method"] = "normuon"
        fields = {f.name for f in dataclasses.fields(self.m["OptimizerConfig"])}
        for item in a.config_set:
            key, _, value = item.partition("=")
            if key not in fields:
                raise ValueError(f"--set {item}: OptimizerConfig has no field {key!r}")
            cfg[key] = parse_value(key, value)
        cfg = {k: v for k, v in cfg.items() if k in fields}
        return self.m["OptimizerConfig"](**cfg)

    def patch_for(self, variant, backend=None):
        """Inside megatron_globals(): what the variant does to Megatron before get_megatron_optimizer()."""
        nm, backend = self.nm, backend or self.args.backend
        if variant in ("normuon", "normuon-nosplit"):
            nm.register("normuon", replace_adam=True, backend=backend)
        elif variant == "normuon-stock":
            nm.register("adaptive_muon", replace_existing=True, replace_adam=True, backend=backend)
        elif variant == "adamw":
            nm.replace_adam(backend=backend)
        elif variant == "mcore-normuon":
            if not self.mopt.HAVE_EMERGING_OPTIMIZERS:
                raise RuntimeError("Megatron's adaptive_muon needs the emerging_optimizers package (>= 0.2), which is "
                                   "not importable here: install .whl/emerging_optimizers-*.whl (Python 3.12)")

    # ------------------------------------------------------------------ building

    def build(self, variant, mode, backend=None):
        """Model (GPTModel, local spec, bf16, Float16Module, DDP), optimizer, scheduler, timers: one Megatron
        setup, as megatron.training's setup_model_and_optimizer wires it."""
        torch, a, m = self.torch, self.args, self.m
        self.seed()
        tcfg = m["TransformerConfig"](
            num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
            num_query_groups=a.num_query_groups, ffn_hidden_size=a.ffn_hidden_size, bf16=True,
            params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=a.device == "cpu", init_method_std=0.02)
        gpt = m["GPTModel"](config=tcfg, transformer_layer_spec=m["local_spec"](), vocab_size=a.vocab_size,
                            max_sequence_length=a.seq_length, position_embedding_type="rope",
                            share_embeddings_and_output_weights=False)
        if a.device == "cuda":
            gpt.cuda(torch.cuda.current_device())
        chunk = m["Float16Module"](tcfg, gpt)
        ddp_config = m["DDPConfig"](grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
                                    use_distributed_optimizer=False, check_for_nan_in_grad=True, bucket_size=None)
        layout = None
        if mode in ("distopt", "layerwise-layout"):
            ddp_config.use_distributed_optimizer = True
            params = [p for p in chunk.parameters() if p.requires_grad]
            if mode == "layerwise-layout":  # megatron.training.training.wrap_model_chunks_with_ddp, layer-wise branch
                from megatron.core.optimizer.layer_wise_optimizer import (LayerWiseDistributedOptimizer,
                                                                          tag_params_for_buffer_routing)
                tag_params_for_buffer_routing([chunk])
                layout = LayerWiseDistributedOptimizer.compute_full_param_layout(
                    params, None, 1, ddp_config, expert_data_parallel_world_size=1)
            else:
                from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
                layout = DistributedOptimizer.compute_full_param_layout(
                    params, None, 1, ddp_config, expert_data_parallel_world_size=1)
        kwargs = {"full_param_layout": layout} if layout is not None else {}
        model = m["DDP"](tcfg, ddp_config, chunk, **kwargs)
        timers = m["Timers"](2, "minmax")
        ocfg = self.optimizer_config(variant, mode, timers)
        with self.megatron_globals():
            self.patch_for(variant, backend)
            optimizer = m["get_megatron_optimizer"](ocfg, [model])
        # megatron.training's get_optimizer_param_scheduler: steps count samples (iterations x global batch)
        gbs = a.micro_batch_size
        scheduler = m["Scheduler"](
            optimizer, init_lr=0.0, max_lr=a.lr, min_lr=a.min_lr, lr_warmup_steps=a.lr_warmup_iters * gbs,
            lr_decay_steps=a.iters * gbs, lr_decay_style=a.lr_decay_style, start_wd=a.weight_decay,
            end_wd=a.weight_decay, wd_incr_steps=a.iters * gbs, wd_incr_style="constant")
        # what megatron.training.training.train() sets on the model config before the loop
        tcfg.grad_scale_func = optimizer.scale_loss
        tcfg.timers = timers
        tcfg.finalize_model_grads_func = m["finalize_model_grads"]
        tcfg.no_sync_func = model.no_sync
        return dict(model=model, gpt=gpt, optimizer=optimizer, scheduler=scheduler, timers=timers, config=ocfg,
                    tconfig=tcfg, variant=variant, mode=mode)

    def leaves(self, optimizer):
        """The Megatron optimizers that hold a torch optimizer (through ChainedOptimizer / LayerWise)."""
        if hasattr(optimizer, "chained_optimizers"):
            out = []
            for o in optimizer.chained_optimizers:
                out += self.leaves(o)
            return out
        return [optimizer]

    def describe(self, b):
        """What Megatron built: wrapper and torch optimizer classes, what each holds, the normuon backend, and
        whether normuon's matrices are exactly the parameters is_managed_by_layer_wise_optimizer picks."""
        opt, torch = b["optimizer"], self.torch
        names = {}
        for name, p in b["model"].named_parameters():
            names[id(p)] = name
            main = getattr(p, "main_param", None)
            if main is not None:
                names[id(main)] = name
        out = {"top": qualname(opt), "tree": optimizer_tree(opt), "leaves": []}
        for leaf in self.leaves(opt):
            inner = getattr(leaf, "optimizer", None)
            entry = {"wrapper": qualname(leaf), "optimizer": qualname(inner) if inner is not None else None,
                     "groups": 0, "tensors": 0, "elements": 0, "matrices": 0, "names": []}
            if inner is not None:
                entry["groups"] = len(inner.param_groups)
                for g in inner.param_groups:
                    for p in g["params"]:
                        entry["tensors"] += 1
                        entry["elements"] += p.numel()
                        entry["matrices"] += int(p.dim() == 2)
                        entry["names"].append(names.get(id(p), f"<{tuple(p.shape)}>"))
                backend = getattr(inner, "backend", None)
                if backend is not None and not callable(backend):
                    entry["backend"] = str(backend)
                if hasattr(inner, "split_qkv"):
                    entry["split_qkv"] = bool(inner.split_qkv)
            out["leaves"].append(entry)
        # routing check (normuon variants): the matrices normuon got == Megatron's layer-wise predicate
        if b["variant"] in EMERGING:
            from megatron.core.optimizer.layer_wise_optimizer import is_managed_by_layer_wise_optimizer

            want = sorted(n for n, p in b["model"].named_parameters()
                          if p.requires_grad and is_managed_by_layer_wise_optimizer(p))
            got = sorted(n for e in out["leaves"] if e["optimizer"] and "Muon" in e["optimizer"] for n in e["names"])
            out["routing_check"] = {"muon_params": len(got), "layer_wise_predicate": len(want),
                                    "agree": got == want, "only_muon": sorted(set(got) - set(want))[:10],
                                    "only_predicate": sorted(set(want) - set(got))[:10]}
        qkv = [n for n, p in b["model"].named_parameters() if getattr(p, "is_qkv", False)]
        if qkv:
            p0 = dict(b["model"].named_parameters())[qkv[0]]
            out["qkv"] = {"params": len(qkv), "shape": list(p0.shape),
                          "qkv_split_shapes": list(getattr(p0, "qkv_split_shapes", []) or [])}
        return out

    # ------------------------------------------------------------------ one iteration

    def forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        dev = self.device
        tokens, labels = batch["tokens"].to(dev), batch["labels"].to(dev)
        position_ids, loss_mask = batch["position_ids"].to(dev), batch["loss_mask"].to(dev)
        output = model(tokens, position_ids, None, labels=labels)
        return output, functools.partial(self.loss_func, loss_mask)

    @staticmethod
    def loss_func(loss_mask, output_tensor):
        """pretrain_gpt.py's loss_func: the sum of per-token losses, the token count, and the report."""
        import torch

        losses = output_tensor.view(-1).float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * loss_mask)
        num_tokens = loss_mask.sum().clone().detach().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}

    def train_iteration(self, b, it):
        """megatron.training.training.train_step for one microbatch: zero_grad_buffer, zero_grad, Megatron's
        forward-backward schedule (finalize_model_grads inside), optimizer.step() inside the 'optimizer' timer,
        the scheduler step."""
        torch, a = self.torch, self.args
        model, optimizer, timers = b["model"], b["optimizer"], b["timers"]
        model.zero_grad_buffer()
        optimizer.zero_grad()
        fb = self.m["get_forward_backward_func"]()
        losses_reduced = fb(forward_step_func=self.forward_step, data_iterator=iter([self.batches[it - 1]]),
                            model=[model], num_microbatches=1, seq_length=a.seq_length,
                            micro_batch_size=a.micro_batch_size, decoder_seq_length=a.seq_length, forward_only=False)
        cuda = a.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        timers("optimizer", log_level=1).start(barrier=False)
        t0 = time.perf_counter()
        if cuda:
            ev0.record()
        update_successful, grad_norm, num_zeros = optimizer.step()
        if cuda:
            ev1.record()
            torch.cuda.synchronize()
        wall_ms = 1000.0 * (time.perf_counter() - t0)
        timers("optimizer").stop()
        event_ms = ev0.elapsed_time(ev1) if cuda else None
        lr = [float(g["lr"]) for g in optimizer.param_groups]
        if update_successful:
            b["scheduler"].step(increment=a.micro_batch_size)  # global batch = micro batch (1 microbatch, DP 1)
        timer_ms = {}
        for name in OPTIMIZER_TIMERS:
            t = timers._timers.get(name)  # only the ones Megatron created; creating one here could clash levels
            if t is not None:
                timer_ms[name] = 1000.0 * t.elapsed(reset=True)
        report = losses_reduced[0]["lm loss"].view(-1)
        loss = (report[0] / report[1]).item()
        return dict(iteration=it, loss=loss, loss_hex=float(loss).hex(), grad_norm=None if grad_norm is None
                    else float(grad_norm), update_successful=bool(update_successful), lr=lr[0] if lr else None,
                    lr_groups=sorted(set(lr)), step_wall_ms=wall_ms, step_event_ms=event_ms, timers_ms=timer_ms)

    # ------------------------------------------------------------------ checkpoints

    def sharded_metadata(self, b):
        md = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
              "dp_cp_group": self.m["parallel_state"].get_data_parallel_group(with_context_parallel=True)}
        # checkpointing._build_sharded_state_dict_metadata: the layer-wise optimizer chains a DistributedOptimizer for
        # the Adam groups, so it needs the sharding type too
        if b["config"].use_distributed_optimizer or b["config"].use_layer_wise_distributed_optimizer:
            md["distrib_optim_sharding_type"] = "dp_reshardable"
        return md

    def save(self, b, fmt, folder, iteration):
        """As megatron.training.checkpointing.save_checkpoint does for the format (one rank)."""
        torch = self.torch
        os.makedirs(folder, exist_ok=True)
        model, optimizer, cfg = b["model"], b["optimizer"], b["config"]
        unwrapped = b["gpt"]  # checkpointing.save_checkpoint: model = unwrap_model(model) (no DDP, no Float16Module)
        if fmt == "torch":
            sd = {"checkpoint_version": 3.0, "iteration": iteration, "model": unwrapped.state_dict_for_save_checkpoint(),
                  "optimizer": optimizer.state_dict(), "opt_param_scheduler": b["scheduler"].state_dict()}
            torch.save(sd, os.path.join(folder, "model_optim_rng.pt"))
            if cfg.use_distributed_optimizer:
                optimizer.save_parameter_state(os.path.join(folder, "distrib_optim.pt"))
            if cfg.use_layer_wise_distributed_optimizer:
                optimizer.save_state_dict_to_file(os.path.join(folder, "layer_wise_optimizer_0.pt"))
        else:
            from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

            md = self.sharded_metadata(b)
            sd = {"checkpoint_version": 3.0, "iteration": iteration, "model": unwrapped.sharded_state_dict(metadata=md),
                  "opt_param_scheduler": b["scheduler"].state_dict()}
            sd["optimizer"] = optimizer.sharded_state_dict(sd, metadata=md)
            self.m["dist_checkpointing"].save(sd, folder, content_metadata=_clean_metadata_for_serialization(md))
        torch.distributed.barrier()

    def load(self, b, fmt, folder):
        """As megatron.training.checkpointing.load_checkpoint does for the format (one rank); returns the
        iteration."""
        torch = self.torch
        model, optimizer, cfg = b["model"], b["optimizer"], b["config"]
        if fmt == "torch":
            sd = torch.load(os.path.join(folder, "model_optim_rng.pt"), map_location="cpu", weights_only=False)
            model.load_state_dict(sd["model"], strict=True)
            if cfg.use_layer_wise_distributed_optimizer:
                optimizer.load_state_dict_from_file(os.path.join(folder, "layer_wise_optimizer_0.pt"))
            else:
                optimizer.load_state_dict(sd["optimizer"])
            if cfg.use_distributed_optimizer:
                optimizer.load_parameter_state(os.path.join(folder, "distrib_optim.pt"))
        else:
            dc = self.m["dist_checkpointing"]
            md = dc.load_content_metadata(folder) or {}
            md["dp_cp_group"] = self.m["parallel_state"].get_data_parallel_group(with_context_parallel=True)
            template = {"checkpoint_version": 3.0, "iteration": 0, "model": b["gpt"].sharded_state_dict(metadata=md),
                        "opt_param_scheduler": b["scheduler"].state_dict()}
            template["optimizer"] = optimizer.sharded_state_dict(template, is_loading=True, metadata=md)
            sd = dc.load(template, folder)
            model.load_state_dict(sd["model"], strict=True)
            optimizer.load_state_dict(sd["optimizer"])
        b["scheduler"].load_state_dict(sd["opt_param_scheduler"])
        return int(sd["iteration"])

    # ------------------------------------------------------------------ snapshots

    def snapshot(self, b):
        """CPU copies of every model parameter, every main parameter the torch optimizers hold, every tensor
        of their state, and the group step counters."""
        torch = self.torch
        snap = {}
        for name, p in b["model"].named_parameters():
            snap[f"model/{name}"] = p.detach().to("cpu", copy=True)
        for i, leaf in enumerate(self.leaves(b["optimizer"])):
            inner = getattr(leaf, "optimizer", None)
            if inner is None:
                continue
            label = f"opt{i}:{type(inner).__name__}"
            for gi, g in enumerate(inner.param_groups):
                if "step" in g:
                    step = g["step"]
                    snap[f"{label}/g{gi}/step"] = torch.tensor(float(step.item() if torch.is_tensor(step) else step))
                for pi, p in enumerate(g["params"]):
                    key = f"{label}/g{gi}/p{pi}"
                    snap[f"{key}/main_param"] = p.detach().to("cpu", copy=True)
                    for k, v in (inner.state.get(p) or {}).items():
                        if torch.is_tensor(v):
                            snap[f"{key}/{k}"] = v.detach().to("cpu", copy=True)
                        elif isinstance(v, (int, float)):
                            snap[f"{key}/{k}"] = torch.tensor(float(v))
        return snap

    def compare(self, a_snap, b_snap):
        torch = self.torch
        keys = sorted(set(a_snap) | set(b_snap))
        missing = [k for k in keys if k not in a_snap or k not in b_snap]
        diffs, n_bad, worst = {}, 0, (0.0, None)
        for k in keys:
            if k in missing:
                continue
            x, y = a_snap[k], b_snap[k]
            if x.shape != y.shape or x.dtype != y.dtype:
                n_bad += 1
                diffs[k] = f"shape/dtype {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"
                continue
            same = x.numel() == 0 or bool((x.reshape(-1).view(torch.uint8) == y.reshape(-1).view(torch.uint8)).all())
            if not same:
                n_bad += 1
                d = float((x.double() - y.double()).abs().max())
                diffs[k] = d
                if not worst[1] or d > worst[0]:
                    worst = (d, k)
        return {"bitwise_equal": n_bad == 0 and not missing, "tensors": len(keys), "mismatched": n_bad,
                "missing": missing[:10], "max_abs_diff": worst[0] if worst[1] else 0.0, "worst": worst[1],
                "first_mismatches": dict(list(diffs.items())[:8])}

    @staticmethod
    def compare_losses(ref, got):
        pairs = [(r, g) for r in ref for g in got if r["iteration"] == g["iteration"]]
        bad = [(r["iteration"], r["loss"], g["loss"]) for r, g in pairs
               if r["loss_hex"] != g["loss_hex"] or (r["grad_norm"] != g["grad_norm"])]
        return {"iterations": [r["iteration"] for r, _ in pairs], "bitwise_equal": not bad and bool(pairs),
                "max_abs_diff": max((abs(x - y) for _, x, y in bad), default=0.0), "first_mismatch": bad[:3]}

    # ------------------------------------------------------------------ one run

    def free(self, *bundles):
        for b in bundles:
            if b:
                b.clear()
        gc.collect()
        if self.args.device == "cuda":
            self.torch.cuda.empty_cache()

    def run(self, spec, mode):
        a, torch = self.args, self.torch
        variant, backend = split_spec(spec)
        rec = new_record(spec, mode)
        label = rec["label"]
        self.results["runs"].append(rec)
        print(f"\n=== {label}: {rec['what']}", flush=True)
        stage = "build"
        b = None
        try:
            if a.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            b = self.build(variant, mode, backend)
            rec["built"] = self.describe(b)
            for leaf in rec["built"]["leaves"]:
                print(f"  built {leaf['wrapper'].split('.')[-1]}({leaf['optimizer']}) "
                      f"{leaf['tensors']} tensors, {leaf['elements']} elements"
                      + (f", backend {leaf['backend']}" if "backend" in leaf else ""), flush=True)
            stage = "train"
            ckpt = {}
            for it in range(1, a.iters + 1):
                stage = f"iteration {it}"
                r = self.train_iteration(b, it)
                rec["iterations"].append(r)
                print(f"  it {it:3d} loss {r['loss']:.6f} grad_norm {fmt(r['grad_norm'])} lr {r['lr']:.3e} "
                      f"step {r['step_wall_ms']:.2f} ms", flush=True)
                if a.resume_at and it == a.resume_at:
                    for f in a.formats:
                        stage = f"save {f} at iteration {it}"
                        folder = os.path.join(self.workdir, label, f)
                        try:
                            t0 = time.perf_counter()
                            self.save(b, f, folder, it)
                            ckpt[f] = folder
                            rec["resume"][f] = {"save_s": time.perf_counter() - t0,
                                                "bytes": sum(os.path.getsize(os.path.join(d, x))
                                                             for d, _, xs in os.walk(folder) for x in xs)}
                        except BaseException as error:  # noqa: BLE001 - record, go on with the other format
                            reraise_interrupts(error)
                            rec["resume"][f] = {"error": self.error(rec, stage, error),
                                                "megatron_limitation": rec["errors"][-1]["megatron_limitation"]}
            rec["built"] = self.describe(b)  # again: the normuon backend is known once the first step built it
            if a.device == "cuda":
                rec["max_memory_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
            stage = "snapshot"
            final = self.snapshot(b)
            self.free(b)
            b = None
            if not a.no_determinism_check:
                stage = "determinism rerun"
                b = self.build(variant, mode, backend)
                again = [self.train_iteration(b, it) for it in range(1, a.iters + 1)]
                rec["determinism"] = {"losses": self.compare_losses(rec["iterations"], again),
                                      "state": self.compare(final, self.snapshot(b))}
                self.free(b)
                b = None
            for f, folder in ckpt.items():
                stage = f"resume from {f}"
                try:
                    b = self.build(variant, mode, backend)
                    t0 = time.perf_counter()
                    loaded = self.load(b, f, folder)
                    rec["resume"][f]["load_s"] = time.perf_counter() - t0
                    rec["resume"][f]["loaded_iteration"] = loaded
                    resumed = [self.train_iteration(b, it) for it in range(loaded + 1, a.iters + 1)]
                    rec["resume"][f]["losses"] = self.compare_losses(rec["iterations"], resumed)
                    rec["resume"][f]["state"] = self.compare(final, self.snapshot(b))
                    rec["resume"][f]["resumed_iterations"] = [dict(iteration=r["iteration"], loss=r["loss"],
                                                                   grad_norm=r["grad_norm"]) for r in resumed]
                except BaseException as error:  # noqa: BLE001
                    reraise_interrupts(error)
                    rec["resume"][f]["error"] = self.error(rec, stage, error)
                    rec["resume"][f]["megatron_limitation"] = rec["errors"][-1]["megatron_limitation"]
                finally:
                    self.free(b)
                    b = None
        except BaseException as error:  # noqa: BLE001 - the report must still come out
            reraise_interrupts(error)
            self.error(rec, stage, error)
        finally:
            self.free(b)
        self.summarise(rec)
        return rec

    def error(self, rec, stage, error):
        tb = traceback.format_exc()
        text = f"{stage}: {type(error).__name__}: {error}"
        upstream = self.megatron_limitation(rec, error)
        hint = None
        frames = [f.filename.replace(os.sep, "/") for f in traceback.extract_tb(error.__traceback__)]
        if (not upstream and any(f.endswith("normuon/megatron.py") for f in frames)
                and ("current device" in str(error) or "same device" in str(error))):
            hint = ("a device mismatch inside normuon.megatron: its split-QKV row index tensors (MegatronNorMuon._blocks) "
                    "and the parameter-shaped copies (_assemble) are made on the CPU; compare the normuon-nosplit run")
        rec["errors"].append({"stage": stage, "error": text, "traceback": tb[-4000:], "megatron_limitation": upstream,
                              "hint": hint})
        print(f"  ERROR in {text}\n" + "\n".join("    " + line for line in tb[-2500:].splitlines()), flush=True)
        if upstream:
            print(f"  (a limitation of Megatron itself, not of normuon: {upstream})", flush=True)
        return text

    def megatron_limitation(self, rec, error):
        """A reason when the error is one Megatron's own code raises in this configuration whatever the optimizer
        (so it is not normuon's); None otherwise. Only two precise cases are recognised."""
        frames = [f.filename.replace(os.sep, "/") for f in traceback.extract_tb(error.__traceback__)]
        version = self.nm.megatron_core_version()
        if isinstance(error, AttributeError) and "save_state_dict_to_file" in str(error):
            return (f"megatron-core {version}: with ckpt-format 'torch' and the layer-wise distributed optimizer, "
                    "megatron.training.checkpointing calls optimizer.save_state_dict_to_file(), which the "
                    "ChainedOptimizer([LayerWiseDistributedOptimizer, DistributedOptimizer]) built over DDP's layer-wise "
                    "parameter layout does not have; use torch_dist")
        distopt = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
        last = frames[-1] if frames else ""
        if (rec["variant"] == "adam" and rec["mode"] == "distopt" and not getattr(distopt, "HAVE_APEX_OR_TE", True)
                and last.endswith("megatron/core/optimizer/distrib_optimizer.py")
                and (isinstance(error, AssertionError) or (isinstance(error, KeyError) and "step" in str(error)))):
            return (f"megatron-core {version}: DistributedOptimizer over torch.optim.AdamW (no TE/Apex) cannot resume: "
                    "its state_dict() asserts one per-parameter 'step' and a fresh optimizer has none (torch_dist), "
                    "and load_parameter_state() looks for a 'step' the parameter-state file does not hold (torch)")
        if (rec["variant"] == "mcore-normuon" and isinstance(error, AttributeError) and "scale_mode" in str(error)
                and any("emerging_optimizers/" in f for f in frames)):
            try:
                from importlib import metadata

                eo_version = metadata.version("emerging-optimizers")
            except Exception:  # noqa: BLE001
                eo_version = "?"
            return (f"megatron-core {version} with emerging_optimizers {eo_version}: Emerging-Optimizers' "
                    "AdaptiveMuon.step() reads self.scale_mode, which Megatron's TensorParallelMuon never sets, so "
                    "Megatron's own adaptive_muon cannot step with this pair")
        return None

    def summarise(self, rec):
        its = rec["iterations"]
        later = its[1:] if len(its) > 1 else its
        rec["summary"] = {
            "completed_iterations": len(its),
            "final_loss": its[-1]["loss"] if its else None,
            "first_step_ms": its[0]["step_wall_ms"] if its else None,
            "median_step_wall_ms": median([r["step_wall_ms"] for r in later]),
            "median_step_event_ms": median([r["step_event_ms"] for r in later]),
            "median_timer_ms": {name: median([r["timers_ms"].get(name) for r in later])
                                for name in OPTIMIZER_TIMERS if any(name in r["timers_ms"] for r in later)},
        }
        verdicts, resumes_ok = [], True
        for f in (self.args.formats if self.args.resume_at else []):
            r = rec["resume"].get(f)
            if r is None or ("error" not in r and "state" not in r):
                verdicts.append(f"{f}: not reached")
                resumes_ok = False
            elif "error" in r:
                verdicts.append(f"{f}: {'n/a (Megatron limitation)' if r.get('megatron_limitation') else 'ERROR'}")
                resumes_ok &= bool(r.get("megatron_limitation"))
            else:
                ok = r["losses"]["bitwise_equal"] and r["state"]["bitwise_equal"]
                verdicts.append(f"{f}: {'bitwise equal' if ok else 'DIFFERS'}")
                resumes_ok &= ok
        rec["summary"]["resume_verdict"] = "; ".join(verdicts) if verdicts else "-"
        # ok: every iteration ran, no error other than a recognised Megatron limitation, every resume bit-exact
        # (or impossible in Megatron itself)
        rec["ok"] = (len(its) == self.args.iters and all(e.get("megatron_limitation") for e in rec["errors"])
                     and resumes_ok)
        # n/a: the run could not complete, and only because of Megatron itself (e.g. Megatron's own adaptive_muon)
        rec["status"] = "ok" if rec["ok"] else (
            "n/a (Megatron)" if rec["errors"] and all(e.get("megatron_limitation") for e in rec["errors"]) else "FAIL")

    # ------------------------------------------------------------------ report

    def environment(self):
        torch, a = self.torch, self.args
        env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "command": " ".join(shlex.quote(x) for x in [sys.executable] + sys.argv),
               "cwd": os.getcwd(), "python": platform.python_version(), "torch": torch.__version__,
               "megatron_core": self.nm.megatron_core_version(), "megatron_source": self.megatron_source,
               "megatron_core_file": getattr(self.mc, "__file__", None),
               "normuon_path": self.normuon_path, "host": platform.node(), "platform": platform.platform(),
               "device": a.device, "megatron_fallback_warnings": self.import_warnings,
               "using_pytorch_optimizer": getattr(self.mopt, "USING_PYTORCH_OPTIMIZER", None),
               "have_emerging_optimizers": getattr(self.mopt, "HAVE_EMERGING_OPTIMIZERS", None),
               "normuon_backend_env": os.environ.get("NORMUON_BACKEND"), "deterministic": not a.no_deterministic}
        if a.device == "cuda":
            for key, get in (("gpu", lambda: torch.cuda.get_device_name(0)), ("cuda", lambda: torch.version.cuda),
                             ("nccl", lambda: str(torch.cuda.nccl.version())),
                             ("gpu_memory_gib", lambda: round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))):
                try:
                    env[key] = get()
                except Exception as error:  # noqa: BLE001 - a report field, never a reason to stop
                    env[key] = f"? ({type(error).__name__}: {error})"
        else:
            env["gpu"] = None
            env["note"] = ("CPU dry run: Megatron's CUDA calls redirected to the CPU (CpuDryRun); the times are not "
                           "GPU times")
        try:
            import emerging_optimizers  # noqa: F401
            from importlib import metadata

            env["emerging_optimizers"] = metadata.version("emerging-optimizers")
        except Exception:  # noqa: BLE001
            env["emerging_optimizers"] = None
        env.update({k: getattr(a, k) for k in ("iters", "resume_at", "num_layers", "hidden_size",
                                                "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                                                "vocab_size", "seq_length", "micro_batch_size", "data", "seed", "lr",
                                                "min_lr", "lr_warmup_iters", "lr_decay_style", "weight_decay",
                                                "clip_grad", "config_set", "backend")})
        return env

class Report:
    """The report of a set of runs (the results dict this script writes as JSON); needs neither torch nor
    Megatron, so the parent process of --isolate can write it even when every child died."""

    def __init__(self, results, args):
        self.results, self.args = results, args

    SHORT = {"adam": "adam", "normuon": "nm", "normuon-stock": "nm-stock", "normuon-nosplit": "nm-nosplit",
             "adamw": "nm-adamw", "mcore-normuon": "mc-normuon"}

    def short_label(self, r):
        backend = r.get("backend")
        return (self.SHORT.get(r["variant"], r["variant"]) + (f"@{backend[:3]}" if backend else "")
                + (MODES[r["mode"]][1] if r.get("mode", "off") != "off" else ""))

    @staticmethod
    def short_tree(text):
        for long, short in (("Float16OptimizerWithFloat16Params", "F16"), ("LayerWiseDistributedOptimizer", "LayerWise"),
                            ("DistributedOptimizer", "DistOpt"), ("ChainedOptimizer", "Chain"),
                            ("normuon.megatron.", ""), ("torch.optim.adamw.AdamW", "torch.AdamW"),
                            ("megatron.core.optimizer.emerging_optimizers.", "mcore.")):
            text = text.replace(long, short)
        return text

    def report_text(self, markdown=False):
        """The report: Markdown for --markdown, else the compact text printed last on stdout (only the last 12,000
        characters of a remote run's output may come back, so it abbreviates)."""
        env, runs, a = self.results.get("setup", {}), self.results["runs"], self.args
        compact = not markdown
        bullet = "* " if markdown else ""
        lines = []
        h = (lambda s: f"\n## {s}\n") if markdown else (lambda s: f"--- {s}")
        lines.append("# Megatron-LM GPT run: normuon vs Megatron's Adam" if markdown else
                     "=================== REPORT: bench/megatron_gpt.py ===================")
        for k in ("date", "device", "gpu", "gpu_memory_gib", "cuda", "nccl", "torch", "python", "megatron_core",
                  "megatron_source", "emerging_optimizers", "normuon_path", "process_group_backend", "host", "command",
                  "note"):
            if env.get(k) is not None:
                value = f"`{env[k]}`" if markdown and k == "command" else env[k]
                lines.append(f"{bullet}{k}: {value}")
        lines.append(f"{bullet}model: GPTModel, local spec, {a.num_layers} layers, hidden "
                     f"{a.hidden_size}, {a.num_attention_heads} heads / {a.num_query_groups} query groups, ffn "
                     f"{a.ffn_hidden_size}, vocab {a.vocab_size}, seq {a.seq_length}, micro batch "
                     f"{a.micro_batch_size}, bf16 params, fp32 grads (grad_reduce_in_fp32), rope, dropout 0; data {a.data}; "
                     f"lr {a.lr:g} ({a.lr_decay_style}, warmup {a.lr_warmup_iters} from 0, min {a.min_lr:g}), "
                     f"wd {a.weight_decay:g}, clip {a.clip_grad:g}" + (f"; --set {a.config_set}" if a.config_set else ""))
        if env.get("megatron_fallback_warnings") and not compact:
            lines.append(f"{bullet}Megatron at import: " + " | ".join(env["megatron_fallback_warnings"]))
        labels = [self.short_label(r) if compact else r["label"] for r in runs]
        if compact:
            short = {"distopt": "DistributedOptimizer", "layerwise": "LayerWise, ping-pong path",
                     "layerwise-layout": "LayerWise + DistributedOptimizer over DDP's layer-wise layout"}
            used = sorted({r.get("mode", "off") for r in runs} - {"off"})
            lines.append("runs: nm = normuon, @ref = @reference" + "".join(f", {MODES[m][1]} = {short[m]}" for m in used)
                         + " (full names in --json/--markdown)")

        lines.append(h("optimizers Megatron built"))
        for r, label in zip(runs, labels):
            built = r.get("built")
            if not built:
                lines.append(f"{bullet}{label}: not built")
                continue
            backends = sorted({leaf["backend"] for leaf in built["leaves"] if "backend" in leaf})
            splits = sorted({str(leaf["split_qkv"]) for leaf in built["leaves"] if "split_qkv" in leaf})
            extra = ""
            if backends:
                extra += f"; normuon backend {'/'.join(backends)}"
            if splits:
                extra += f"; split_qkv {'/'.join(splits)}"
            if "routing_check" in built:
                rc = built["routing_check"]
                extra += (f"; its {rc['muon_params']} matrices {'==' if rc['agree'] else 'DIFFER FROM'} Megatron's "
                          f"is_managed_by_layer_wise_optimizer ({rc['layer_wise_predicate']})")
            tree = self.short_tree(built["tree"]) if compact else built["tree"]
            lines.append(f"{bullet}{label}: {tree}{extra}")
            if not compact:
                lines.append("    holding: " + " + ".join(
                    f"{leaf['wrapper'].rsplit('.', 1)[-1]}({leaf['optimizer']}: {leaf['tensors']} tensors, "
                    f"{leaf['elements']} elements)" for leaf in built["leaves"]))
        qkv = next((r["built"]["qkv"] for r in runs if r.get("built", {}).get("qkv")), None)
        if qkv:
            lines.append(f"{bullet}QKV: {qkv['params']} linear_qkv weights of shape {qkv['shape']}, "
                         f"qkv_split_shapes {qkv['qkv_split_shapes']} per query group")

        lines.append(h("loss per iteration (mean cross entropy over the batch's tokens; the same batches for every run)"))
        digits = ".4f" if compact else ".6f"
        lines += self.table(["iter"] + labels, [[str(it)] + [fmt(self.iter_value(r, it, "loss"), digits) for r in runs]
                                                 for it in range(1, a.iters + 1)], markdown)
        if markdown:
            lines.append(h("grad norm per iteration (Megatron's, before clipping)"))
            lines += self.table(["iter"] + labels, [[str(it)] + [fmt(self.iter_value(r, it, "grad_norm"), ".5f")
                                                                 for r in runs] for it in range(1, a.iters + 1)], markdown)
        else:
            lines.append("(grad norms, lr and every timer per iteration: --json / --markdown)")

        lines.append(h(f"optimizer.step() time (ms), median over iterations 2..{a.iters}"))
        names = [n for n in OPTIMIZER_TIMERS if n != "forward-backward"
                 and any(n in r.get("summary", {}).get("median_timer_ms", {}) for r in runs)]
        if compact:
            names = [n for n in names if n in ("optimizer", "optimizer-inner-step")]
        rows = []
        for r, label in zip(runs, labels):
            sm = r.get("summary", {})
            t = sm.get("median_timer_ms", {})
            rows.append([label, fmt(sm.get("median_step_event_ms"), ".3f"), fmt(sm.get("median_step_wall_ms"), ".3f")]
                        + [fmt(t.get(n), ".3f") for n in names] + [fmt(sm.get("first_step_ms"), ".1f")])
        lines += self.table(["run", "CUDA events", "wall"] + [f"timer {n}" for n in names] + ["first step"], rows,
                            markdown)
        lines.append("(CUDA events, wall: around optimizer.step(); timer X: Megatron's Timers ('optimizer' is train_step's, "
                     "around optimizer.step()); first step: iteration 1's wall time, normuon's layout build included)")

        if a.resume_at:
            lines.append(h(f"checkpoint resume (save after iteration {a.resume_at}, resume a fresh model and optimizer "
                           f"from it, run to {a.iters}, compare bit for bit with the uninterrupted run)"))
        else:
            lines.append(h("checkpoint resume: not tested (--resume-at 0)"))
        rows = []
        for r, label in zip(runs, labels):
            det = r.get("determinism")
            dtext = "-" if not det else ("bitwise" if det["losses"]["bitwise_equal"] and det["state"]["bitwise_equal"]
                                         else f"DIFFERS (max {det['state']['max_abs_diff']:.3g})")
            for f in a.formats if a.resume_at else []:
                x = r["resume"].get(f)
                if x is None:
                    rows.append([label, f, "not reached", "-", "-", "-", dtext])
                elif "error" in x:
                    what = "n/a (Megatron)" if x.get("megatron_limitation") else "ERROR"
                    text = "" if compact and x.get("megatron_limitation") else ": " + str(x["error"])[:40 if compact else 200]
                    rows.append([label, f, what + text, "-", "-", "-", dtext])
                elif "state" not in x:
                    rows.append([label, f, "not reached (error before the resume)", "-", "-", "-", dtext])
                else:
                    st, lo = x["state"], x["losses"]
                    worst = f" ({st['worst']})" if st["worst"] and not compact else ""
                    rows.append([label, f, "BITWISE EQUAL" if st["bitwise_equal"] and lo["bitwise_equal"] else "DIFFERS",
                                 f"{'equal' if lo['bitwise_equal'] else 'differ'}"
                                 + ("" if lo["bitwise_equal"] else f" (max {lo['max_abs_diff']:.3g})"),
                                 f"{st['tensors'] - st['mismatched']}/{st['tensors']}",
                                 f"{st['max_abs_diff']:.3g}{worst}", dtext])
        if rows:
            lines += self.table(["run", "format", "verdict", "losses, grad norms", "tensors equal", "max abs diff",
                                 "rerun from scratch"], rows, markdown)
            lines.append("(tensors: model parameters, main parameters, optimizer state, group steps; rerun from scratch: "
                         "a second uninterrupted run, to tell nondeterminism apart from resume errors)")

        errors = [(label, e) for r, label in zip(runs, labels) for e in r["errors"]]
        if errors:
            lines.append(h("errors"))
            reasons, same = {}, {}
            for label, e in errors:
                if e.get("megatron_limitation"):
                    reasons.setdefault(e["megatron_limitation"], []).append(f"{label} ({e['stage']})")
                    continue
                # the same error in several runs is printed once
                message = e["error"].split(": ", 1)[-1]
                same.setdefault(message, []).append((label, e))
            for message, where in same.items():
                e = where[0][1]
                runs_text = ", ".join(f"{label} ({x['stage']})" for label, x in where)
                lines.append(f"{bullet}{runs_text}: {message[:400 if compact else 1500]}")
                if e.get("hint"):
                    lines.append(f"    hint: {e['hint']}")
                tail = [x.strip()[:200] for x in e["traceback"].strip().splitlines() if x.strip()]
                tail = [x for x in tail if not x.startswith("^")][-(6 if compact else 14):]
                lines += ["    " + x for x in tail]
            for reason, where in reasons.items():
                lines.append(f"{bullet}n/a, Megatron's own limitation (not normuon's), in {', '.join(where)}: {reason}")
        ok = self.results.get("ok", False)
        lines.append("")
        lines.append("run status: " + ", ".join(f"{label} {r.get('status', '?')}" for r, label in zip(runs, labels)))
        lines.append(f"{'**' if markdown else ''}overall: {'PASS' if ok else 'FAIL'}{'**' if markdown else ''} "
                     f"({sum(r.get('status') == 'ok' for r in runs)}/{len(runs)} runs completed every iteration with "
                     "bit-exact resumes; Megatron's own limitations are n/a, not failures)")
        return "\n".join(lines) + "\n"

    @staticmethod
    def iter_value(r, it, key):
        for x in r["iterations"]:
            if x["iteration"] == it:
                return x[key]
        return None

    @staticmethod
    def table(header, rows, markdown):
        if markdown:
            out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
            out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
            return out
        widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
        out = ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(header, widths)))]
        out += ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
                for row in rows]
        return out



# ----------------------------------------------------------------------------------------------- pretrain_gpt

def pretrain_gpt_command(args):
    """The stock pretrain_gpt.py --mock-data with tiny sizes and normuon registered as 'adaptive_muon', through
    bench/megatron_pretrain_gpt.py. Returns (argv, env additions)."""
    mlm = os.path.abspath(args.megatron_path or os.path.join(REPO, ".megatron-lm"))
    save = os.path.join(tempfile.gettempdir(), "megatron_gpt_pretrain_" + time.strftime("%Y%m%d-%H%M%S"))
    argv = [sys.executable, os.path.join(REPO, "bench", "megatron_pretrain_gpt.py"), "--megatron-lm", mlm, "--",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(args.vocab_size),
            "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads), "--group-query-attention",
            "--num-query-groups", str(args.num_query_groups), "--ffn-hidden-size", str(args.ffn_hidden_size),
            "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
            "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(args.micro_batch_size),
            "--train-iters", str(args.iters), "--lr", str(args.lr), "--min-lr", str(args.min_lr),
            "--lr-decay-style", "cosine", "--lr-warmup-iters", str(args.lr_warmup_iters),
            "--weight-decay", str(args.weight_decay), "--clip-grad", str(args.clip_grad), "--bf16",
            "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
            "--attention-dropout", "0", "--hidden-dropout", "0", "--position-embedding-type", "rope",
            "--untie-embeddings-and-output-weights", "--optimizer", "adaptive_muon",
            "--muon-coefficient-type", "simple", "--muon-momentum", "0.95", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--adam-eps", "1e-8", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", str(10 * args.iters),
            "--save", save, "--save-interval", str(max(args.resume_at, 1)), "--ckpt-format", "torch_dist",
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--seed", str(args.seed),
            "--timing-log-level", "2"] + list(args.pretrain_arg)
    return argv, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                  "LOCAL_RANK": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


# ----------------------------------------------------------------------------------------------- main

def overall_ok(runs):
    return bool(runs) and all(r.get("status") in ("ok", "n/a (Megatron)") for r in runs) and \
        any(r.get("status") == "ok" for r in runs)


def write_outputs(args, results, print_report):
    results["ok"] = overall_ok(results["runs"])
    if args.json:
        write_atomic(args.json, json.dumps(results, indent=1, default=str) + "\n")
    if args.markdown:
        write_atomic(args.markdown, Report(results, args).report_text(markdown=True))
    if print_report:
        print(Report(results, args).report_text(markdown=False), flush=True)


def run_in_process(args):
    """Every run in this process (--no-isolate), or the one run of a child (--child-run)."""
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
    if args.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    try:
        import torch
    except ImportError as error:
        fail_setup(f"torch is not importable ({error})")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail_setup("--device cuda, but torch sees no GPU (torch.cuda.is_available() is False); use --device cpu for "
                   "a dry run")
    core, source, import_warnings = import_megatron(args)
    normuon, nm, normuon_path = import_normuon(args)
    if not args.no_deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        if hasattr(torch, "utils") and hasattr(torch.utils, "deterministic"):
            torch.utils.deterministic.fill_uninitialized_memory = False  # no NaN fill of torch.empty: no time cost
    dry = CpuDryRun() if args.device == "cpu" else contextlib.nullcontext()
    bench = Bench(args, core, source, import_warnings, normuon, nm, normuon_path)
    with dry:
        bench.init_distributed()
        bench.results["setup"].update(bench.environment())
        bench.make_batches()
        try:
            for spec, mode in run_plan(args):
                bench.run(spec, mode)
                if not args.child_run:  # partial results survive a later crash or a time limit
                    write_outputs(args, bench.results, print_report=False)
        finally:
            shutil.rmtree(bench.workdir, ignore_errors=True)
            if args.child_run:
                bench.results["ok"] = overall_ok(bench.results["runs"])
                write_atomic(args.child_json, json.dumps(bench.results, indent=1, default=str) + "\n")
            else:
                write_outputs(args, bench.results, print_report=True)
        with contextlib.suppress(Exception):
            torch.distributed.destroy_process_group()
    return 0 if overall_ok(bench.results["runs"]) else 1


def child_argv(argv, variant, mode, child_json):
    """This script's command line for one run in a child process."""
    drop_with_value = {"--json", "--markdown", "--optimizers", "--distributed-optimizer", "--time-budget", "--layer-wise"}
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        name = item.split("=", 1)[0]
        if name in drop_with_value:
            skip = "=" not in item
            continue
        if name in ("--isolate", "--no-isolate"):
            continue
        out.append(item)
    return [sys.executable, os.path.abspath(__file__)] + out + [
        "--optimizers", variant, "--distributed-optimizer", "off" if mode == "off" else "on",
        "--layer-wise", "layout" if mode == "layerwise-layout" else "ping-pong", "--child-run", "--child-json", child_json]


def run_isolated(args, argv):
    """Each run in its own process: a crash (a signal, a sticky CUDA error, an abort in native code) or a hang
    loses that run only; the report still comes out, within --time-budget."""
    started = time.monotonic()
    results = {"runs": [], "setup": {"command": " ".join(shlex.quote(x) for x in [sys.executable] + sys.argv),
                                     "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                                     "python": platform.python_version(), "device": args.device,
                                     "isolated": True}}
    folder = tempfile.mkdtemp(prefix="megatron_gpt-runs-")
    status = None
    try:
        for variant, mode in run_plan(args):
            base = new_record(variant, mode)
            left = args.time_budget - (time.monotonic() - started)
            if left < 20:
                base["status"] = "skipped (time budget)"
                base["errors"].append({"stage": "not started", "error": f"not started: --time-budget "
                                       f"{args.time_budget:g} s nearly spent", "traceback": ""})
                results["runs"].append(base)
                continue
            child_json = os.path.join(folder, f"{len(results['runs'])}.json")
            cmd = child_argv(argv, variant, mode, child_json)
            tail = collections.deque(maxlen=40)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    errors="replace", start_new_session=True)

            def pump(stream=proc.stdout, keep=tail):
                for line in stream:
                    keep.append(line.rstrip("\n"))
                    sys.stdout.write(line)
                    sys.stdout.flush()

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            try:
                code = proc.wait(timeout=left)
                timed_out = False
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: it and what it started
                code = proc.wait()
                timed_out = True
            reader.join(timeout=10)
            if code == 2 and not os.path.exists(child_json):  # setup missing: the same for every run
                print("\n".join(tail), file=sys.stderr)
                status = 2
                return status
            child = None
            if os.path.exists(child_json):
                with open(child_json) as f:
                    child = json.load(f)
            if child and child.get("runs"):
                if not results["setup"].get("torch"):
                    results["setup"] = dict(child.get("setup", {}), command=results["setup"]["command"],
                                            isolated=True)
                results["runs"] += child["runs"]
            else:
                why = (f"killed after {left:.0f} s (--time-budget)" if timed_out else
                       f"the process died by signal {-code}" if code < 0 else f"the process exited with {code}")
                base["errors"].append({"stage": "process", "error": f"process: {why}, before writing its results",
                                       "traceback": "\n".join(tail)})
                base["status"] = "FAIL"
                results["runs"].append(base)
            write_outputs(args, results, print_report=False)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if status is None:
            write_outputs(args, results, print_report=True)
    return 0 if overall_ok(results["runs"]) else 1


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.pretrain_gpt:
        cmd, env = pretrain_gpt_command(args)
        text = " ".join(f"{k}={v}" for k, v in env.items()) + " " + " ".join(shlex.quote(c) for c in cmd)
        print(text)
        if not args.run_pretrain_gpt:
            return 0
        return subprocess.call(cmd, env=dict(os.environ, **env))
    if args.isolate and not args.child_run:
        return run_isolated(args, argv)
    return run_in_process(args)


if __name__ == "__main__":
    sys.exit(main())
