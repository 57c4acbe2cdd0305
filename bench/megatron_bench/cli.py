"""The command line of bench/megatron_gpt.py and its checks, which run before megatron-core is imported."""
import argparse
import sys

from .plan import BACKENDS, FORMATS, OURS, VARIANTS, split_spec


def parse_args(argv, doc):
    """The arguments; `doc` is bench/megatron_gpt.py's docstring (the description, and --help-long)."""
    p = argparse.ArgumentParser(
        prog="bench/megatron_gpt.py",
        description=doc.split("\n\n")[0] + " See the module docstring (or --help-long) for the details.",
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
        print(doc)
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
