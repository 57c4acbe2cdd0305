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
# The code is in the package bench/megatron_bench/ (its __init__.py lists the modules); this file parses the
# command line and dispatches.
import os
import shlex
import subprocess
import sys

# bench/ is sys.path[0]: this script runs as bench/megatron_gpt.py (megatron_bench/ and peers/ are beside it)
from megatron_bench.cli import parse_args
from megatron_bench.in_process import run_in_process
from megatron_bench.isolated import run_isolated
from megatron_bench.pretrain_command import pretrain_gpt_command


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv, __doc__)
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
