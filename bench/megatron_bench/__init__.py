"""The parts of bench/megatron_gpt.py (a real Megatron-LM training run of normuon beside Megatron's Adam;
its docstring says what it does and how to run it). Stdlib only at import: torch, megatron-core and normuon
are imported when a run starts, so the argument checks and the report need none of them. Not named
`megatron`: bench/ is sys.path[0] when the script runs, and a bench/megatron/ would hide megatron-core's
`megatron` package.

  plan.py            the variants, the distributed-optimizer modes, the checkpoint formats, the timers; the
                     (variant, mode) runs and a run's record
  cli.py             the command line and its checks (before anything heavy is imported)
  imports.py         finding megatron-core and normuon (the environment, else source or build folders)
  cpu_dry_run.py     Megatron's CUDA calls redirected to the CPU (--device cpu; bench/megatron_pretrain_gpt.py)
  helpers.py         where things are, a free port, class names, the optimizer tree, --set values, numbers
  bench.py           class Bench: one run of a variant (train, save, rerun, resume, verdict), the environment;
                     its mixins:
    build.py           the process group, seeds, Megatron's model and optimizer for a variant, what it built
    train.py           the batches and one training iteration as Megatron's train_step does it
    checkpoints.py     saving and loading as Megatron's checkpointing does ('torch', 'torch_dist')
    compare.py         snapshots of parameters and optimizer state, compared bit for bit
    failures.py        recording an error, and telling Megatron's own limitations apart
  report.py          the report (text and Markdown), the overall verdict, writing --json/--markdown
  in_process.py      every run in this process (--no-isolate), or a child's one run (--child-run)
  isolated.py        each run in a child process within --time-budget (--isolate, the default)
  pretrain_command.py  the stock pretrain_gpt.py command (--pretrain-gpt)
"""
