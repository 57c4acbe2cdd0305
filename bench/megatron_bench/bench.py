"""One run of a variant in one distributed-optimizer mode: build, train (saving checkpoints on the way),
a rerun from scratch, the resumes, and the verdict; and the environment for the report."""
import datetime
import gc
import importlib
import os
import platform
import shlex
import sys
import tempfile
import time

from .build import Build
from .checkpoints import Checkpoints
from .compare import Compare
from .failures import Failures, reraise_interrupts
from .helpers import fmt, median
from .plan import OPTIMIZER_TIMERS, new_record, split_spec
from .train import Train


class Bench(Build, Train, Checkpoints, Compare, Failures):
    """Megatron's modules, the fixed batches, and the results of every run (self.results, written as JSON);
    run() does one (variant spec, mode)."""

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

    # ------------------------------------------------------------------ the environment, for the report

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
