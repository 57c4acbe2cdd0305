"""Runs in this process: every run (--no-isolate), or the one run of a child of --isolate (--child-run)."""
import contextlib
import json
import logging
import os
import shutil
import warnings

from peers.files import write_atomic

from .bench import Bench
from .cpu_dry_run import CpuDryRun
from .imports import fail_setup, import_megatron, import_normuon
from .plan import run_plan
from .report import overall_ok, write_outputs


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
