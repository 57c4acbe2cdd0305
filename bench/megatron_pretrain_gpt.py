#!/usr/bin/env python3
"""Runs Megatron-LM's stock pretrain_gpt.py with normuon registered first.

The stock script's --optimizer has a fixed list of choices, so normuon is registered under one of them
(docs/megatron.md, "Switching a Megatron run to it"):

    normuon.megatron.register("adaptive_muon", replace_existing=True, replace_adam=True)

after which `--optimizer adaptive_muon --muon-coefficient-type simple` builds normuon's MegatronNorMuon for
the hidden matrices and MegatronAdamW for the rest. Then pretrain_gpt.py runs as __main__ (runpy) with
everything after `--` as its command line.

    python3 bench/megatron_pretrain_gpt.py [--megatron-lm DIR] [--name adaptive_muon] [--no-replace-adam]
        [--backend B] [--stock] [--check-args | --cpu-dry-run] -- <pretrain_gpt.py arguments>

--megatron-lm is the Megatron-LM source tree that holds pretrain_gpt.py, gpt_builders.py and
model_provider.py (default: REPO/.megatron-lm). It is appended to sys.path, so an installed megatron-core
(e.g. the wheel in /tmp/site on PYTHONPATH) is used before the tree's own copy. --stock runs pretrain_gpt.py
without registering anything (Megatron's own optimizers). --check-args only parses and validates the
arguments with Megatron's parse_and_validate_args and prints the optimizer settings (no GPU needed).
--cpu-dry-run runs it on the CPU (gloo, no DataLoader workers, no torch.compile, Megatron's CUDA calls
redirected by bench/megatron_gpt.py's CpuDryRun): a check of the command line and the wiring on a machine
without a GPU, nothing more.

Two things are done to Megatron besides the registration: when the dataset helper (helpers_cpp) is already
built, as in the megatron-core wheel, which ships no Makefile, Megatron's compile_helpers() (`make`) is
skipped; and get_megatron_optimizer() is wrapped to print the optimizer Megatron built.
`bench/megatron_gpt.py --pretrain-gpt` prints a ready command with tiny sizes and --mock-data.
"""
import argparse
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:  # bench/ is sys.path[0] when this runs as bench/megatron_pretrain_gpt.py
    sys.path.insert(0, HERE)

from megatron_bench.cpu_dry_run import CpuDryRun  # noqa: E402 - stdlib only at import; torch when used
from megatron_bench.helpers import optimizer_tree  # noqa: E402


def skip_compile_if_built():
    """megatron.training's initialize runs `make -C megatron/core/datasets` (compile_helpers) on rank 0. The
    megatron-core wheel ships that helper compiled and no Makefile, so make would fail and Megatron exit: when
    helpers_cpp imports, compile_helpers becomes a no-op."""
    try:
        import megatron.core.datasets.helpers_cpp as helpers_cpp  # noqa: F401
        import megatron.core.datasets.utils as dataset_utils
    except ImportError:
        return  # not built: Megatron's own compile_helpers (make) has to build it
    where = getattr(helpers_cpp, "__file__", "?")

    def compile_helpers():
        print(f"megatron_pretrain_gpt.py: dataset helpers already built ({where}); not running make", flush=True)

    dataset_utils.compile_helpers = compile_helpers


def report_built_optimizer():
    """Prints what get_megatron_optimizer() built (before megatron.training imports it by name), so the log
    shows that the optimizer is normuon's."""
    import megatron.core.optimizer as mopt

    original = mopt.get_megatron_optimizer

    def get_megatron_optimizer(*args, **kwargs):
        optimizer = original(*args, **kwargs)
        print(f"megatron_pretrain_gpt.py: Megatron built {optimizer_tree(optimizer)}", flush=True)
        return optimizer

    mopt.get_megatron_optimizer = get_megatron_optimizer


def main():
    argv = sys.argv[1:]
    if "--" in argv:
        cut = argv.index("--")
        own, rest = argv[:cut], argv[cut + 1:]
    else:
        own, rest = argv, []
    p = argparse.ArgumentParser(prog="bench/megatron_pretrain_gpt.py", description=__doc__.split("\n\n")[0],
                                epilog="Everything after -- goes to pretrain_gpt.py. See the module docstring.")
    p.add_argument("--megatron-lm", default=os.path.join(REPO, ".megatron-lm"),
                   help="Megatron-LM source tree with pretrain_gpt.py (default REPO/.megatron-lm)")
    p.add_argument("--name", default="adaptive_muon",
                   help="the --optimizer choice to register normuon under (default adaptive_muon)")
    p.add_argument("--no-replace-adam", action="store_true", help="keep Megatron's Adam for the Adam groups")
    p.add_argument("--backend", default=None, help="normuon backend (default: NORMUON_BACKEND, else fast)")
    p.add_argument("--stock", action="store_true", help="register nothing: Megatron's own optimizers")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--check-args", action="store_true",
                     help="only parse and validate the pretrain_gpt.py arguments (Megatron's parse_and_validate_args)")
    how.add_argument("--cpu-dry-run", action="store_true",
                     help="run on the CPU with Megatron's CUDA calls redirected (bench/megatron_gpt.py's CpuDryRun) "
                          "and --distributed-backend gloo: a check of the command on a machine without a GPU, nothing "
                          "more")
    args = p.parse_args(own)

    if args.cpu_dry_run:
        os.environ["TORCHDYNAMO_DISABLE"] = "1"  # torch.compile'd fusions would initialise CUDA
    script = os.path.join(os.path.abspath(args.megatron_lm), "pretrain_gpt.py")
    if not os.path.isfile(script):
        print(f"megatron_pretrain_gpt.py: {script} does not exist; pass --megatron-lm (a Megatron-LM source tree, "
              "e.g. the carried .megatron-lm)", file=sys.stderr)
        return 2
    # pretrain_gpt.py imports gpt_builders and model_provider from its folder; an installed megatron-core comes first
    sys.path.append(os.path.dirname(script))
    os.environ.setdefault("NO_VCS_VERSION", "1")

    if not args.stock:
        try:
            import normuon.megatron as nm
        except ImportError as error:
            print(f"megatron_pretrain_gpt.py: normuon is not importable ({error}); put its build folder (e.g. "
                  "build-gpu/python) on PYTHONPATH", file=sys.stderr)
            return 2
        try:
            entry = nm.register(args.name, replace_existing=True, replace_adam=not args.no_replace_adam,
                                backend=args.backend)
        except RuntimeError as error:  # megatron-core missing or of an unknown version
            print(f"megatron_pretrain_gpt.py: {error}", file=sys.stderr)
            return 2
        print(f"megatron_pretrain_gpt.py: normuon registered as --optimizer {args.name} "
              f"({entry.optimizer_cls.__module__}.{entry.optimizer_cls.__name__}"
              + ("" if args.no_replace_adam else "; Megatron's Adam is normuon.megatron.MegatronAdamW") + ")",
              flush=True)

    skip_compile_if_built()
    report_built_optimizer()
    if args.cpu_dry_run and "--distributed-backend" not in rest:
        rest = rest + ["--distributed-backend", "gloo"]
    if args.cpu_dry_run and "--num-workers" not in rest:
        rest = rest + ["--num-workers", "0"]  # DataLoader workers pin memory through the CUDA runtime
    sys.argv = [script] + rest
    if args.cpu_dry_run:
        import torch._dynamo

        torch._dynamo.config.disable = True
        with CpuDryRun(claim_cuda_available=True):
            runpy.run_path(script, run_name="__main__")
        return 0
    if args.check_args:
        module = runpy.run_path(script, run_name="pretrain_gpt_check")  # imports only, not the __main__ block
        ns = module["parse_and_validate_args"](args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
        keys = ("optimizer", "muon_coefficient_type", "muon_split_qkv", "muon_tp_mode", "lr", "min_lr",
                "weight_decay", "bf16", "use_distributed_optimizer", "use_layer_wise_distributed_optimizer",
                "transformer_impl", "ckpt_format", "train_iters", "micro_batch_size", "global_batch_size")
        for k in keys:
            print(f"  {k} = {getattr(ns, k, '<absent>')}")
        return 0
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
