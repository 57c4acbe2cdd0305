#!/usr/bin/env python3
"""Old vs new on one device, in one process: this project's fused optimizer against its per-parameter
peers, all stepping the same model (a preset of the `normuon` tool) with the same gradients and the same
hyper-parameters (NorMuon lr 0.02, momentum 0.95, beta2 0.95, weight_decay 0; AdamW lr 3e-4, betas
(0.9, 0.95), eps 1e-10, weight_decay 0). NorMuon (or Muon) steps the 2-D hidden matrices, AdamW the
embeddings, head, norms and biases, by the project's routing rule (docs/spec.md section 2).

Per peer: step time, kernels / copies / launch calls / host syncs / ATen ops per step (torch.profiler),
extra memory, and the speed-up against `official` and `reference`. Peers run one after another, each
on a fresh copy of the model that is freed before the next; one that cannot run is reported as skipped or
failed with the reason. Progress goes to stderr, the table (printed last) to stdout.

    PYTHONPATH=build/python python3 bench/gpu_peers.py --preset gpt-1.3b --markdown out.md --csv out.csv
    PYTHONPATH=build/python python3 bench/gpu_peers.py --device cpu --preset tiny --steps 2 --warmup 1
"""
import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import torch  # noqa: E402

import normuon  # noqa: E402
from peers import measure, report  # noqa: E402
from peers.cli_peer import run_fused_cpp  # noqa: E402
from peers.files import write_atomic  # noqa: E402
from peers.model import DTYPES, ManifestError, bank_specs, load_manifest  # noqa: E402
from peers.optimizers import PEER_NAMES, PEERS, Context  # noqa: E402
from peers.run import Plan, run_python_peer  # noqa: E402

PEER_HELP = "\n".join(f"  {p.name:<24}{p.what}" for p in PEERS)
EPILOG = f"""peers (--peers, in this order):
{PEER_HELP}
  official, torch-muon, emerging-adaptive-muon and reference are per-parameter ("slow"): they take
  --slow-steps / --slow-warmup. dion-normuon is torch.compile'd: its first steps compile, so it wants
  --warmup >= 1 (the default 3 covers it). torch-muon is Muon, not NorMuon. emerging-adaptive-muon steps fp32 copies
  of a bf16 model (it takes fp32 only). official writes into p.grad; its gradients are restored between
  timed steps, outside the timed region. There is no CUDA-graph row for the Python path (fused-py):
  normuon.NorMuonAdamW has no CUDA-graph capture path (its step() waits for the step and reads device
  values on the host, which capture forbids); the C++ step's graph is fused-cpp (graph).

what is measured (also in the markdown report):
{report.DEFINITIONS}

exit status: 0 when the run finished (peers that were skipped or failed are in the table), 2 for bad
arguments (nothing is run or written)."""


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gpu_peers.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    p.add_argument("--preset", default="gpt2-124m",
                   help="preset name(s), comma-separated (`normuon presets`); one table each (default gpt2-124m)")
    p.add_argument("--peers", default=",".join(PEER_NAMES),
                   help="comma-separated peers, run in this order (default: all, in the order below)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--threads", type=int,
                   help="--device cpu: the threads of every peer, torch's (torch.set_num_threads) and the fused "
                        "backend's, the same for all (default: the fused backend's own default, the processors "
                        "this process may use within its CPU quota)")
    p.add_argument("--param-dtype", choices=("f32", "bf16"),
                   help="parameter and gradient dtype (default: the preset's: f32 for tiny and gpt2-124m, bf16 "
                        "for the others)")
    p.add_argument("--steps", type=int, default=10, help="measured steps per peer (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps before them (default 3)")
    p.add_argument("--slow-steps", type=int,
                   help="measured steps of the per-parameter peers (default: the smaller of 5 and --steps; one "
                        "of their steps takes seconds on moe-8x64)")
    p.add_argument("--slow-warmup", type=int,
                   help="warm-up steps of the per-parameter peers (default: the smaller of 1 and --warmup)")
    p.add_argument("--profile-steps", type=int, default=2,
                   help="steps profiled for the counts, after the measured ones (default 2; 0: no counts)")
    p.add_argument("--banks", action="store_true",
                   help="stack each preset's experts (...experts.K.NAME.weight) into 3-D banks ...experts.NAME "
                        "[E, m, n], as transformers 5.x stores them: every peer steps the banks (fused-py-2d their "
                        "experts as 2-D parameters)")
    p.add_argument("--seed", type=int, default=1234, help="seed of parameters and gradients (default 1234)")
    p.add_argument("--official-normuon", default=os.path.join(REPO, ".official", "normuon.py"), metavar="PATH",
                   help="zichongli5/NorMuon's normuon.py (default: .official/normuon.py in the repository)")
    p.add_argument("--dion-src", default=os.path.join(REPO, ".official", "dion"), metavar="PATH",
                   help="a folder holding microsoft/dion's dion/ package, NorMuon's files at least (default: "
                        ".official/dion in the repository)")
    p.add_argument("--cli", default=os.environ.get("NORMUON_CLI") or os.path.join(REPO, "build", "normuon"),
                   help="the normuon tool: manifests and fused-cpp (default: $NORMUON_CLI, else build/normuon)")
    p.add_argument("--markdown", metavar="FILE", help="also write a self-contained markdown report")
    p.add_argument("--csv", metavar="FILE", help="also write every number as CSV")
    args = p.parse_args(argv)

    args.presets = [x for x in args.preset.split(",") if x]
    args.peer_list = [x for x in args.peers.split(",") if x]
    unknown = [x for x in args.peer_list if x not in PEER_NAMES]
    if unknown or not args.peer_list:
        p.error(f"unknown peer(s) {', '.join(unknown) or '(none given)'} (choose from {', '.join(PEER_NAMES)})")
    if not args.presets:
        p.error("--preset: no preset given")
    for name in ("steps", "slow_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("warmup", "slow_warmup", "profile_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    args.slow_steps = min(5, args.steps) if args.slow_steps is None else args.slow_steps
    args.slow_warmup = min(1, args.warmup) if args.slow_warmup is None else args.slow_warmup
    try:
        args.device = torch.device(args.device)
    except RuntimeError as error:
        p.error(f"--device {args.device}: {error}")
    if args.device.type not in ("cpu", "cuda"):
        p.error(f"--device {args.device}: choose cuda, cuda:N or cpu")
    if args.threads is not None and (args.threads < 1 or args.device.type != "cpu"):
        p.error("--threads: a count >= 1, for --device cpu only")
    if args.device.type == "cpu" and args.threads is None:
        args.threads = default_cpu_threads()
    if args.device.type == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False); use --device cpu")
        args.device = torch.device("cuda", args.device.index if args.device.index is not None else 0)
        if args.device.index >= torch.cuda.device_count():
            p.error(f"--device {args.device}: there are {torch.cuda.device_count()} CUDA device(s)")
    for name in ("markdown", "csv"):
        path = getattr(args, name)
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            p.error(f"--{name} {path}: the folder does not exist")
    args.manifests = {}
    for preset in args.presets:  # all of them before anything runs: a bad name costs nothing
        try:
            args.manifests[preset] = load_manifest(args.cli, preset)
            if args.banks:
                args.manifests[preset] = bank_specs(args.manifests[preset])
        except ManifestError as error:
            p.error(f"--preset {preset}: {error}")
    return args


def default_cpu_threads():
    """The fused CPU backend's default (affinity mask and cgroup quota), else the affinity mask."""
    if normuon.native_available():
        from normuon import _C
        if hasattr(_C, "default_threads"):
            return _C.default_threads()
    return len(os.sched_getaffinity(0))


def log_to_stderr():
    start = time.perf_counter()

    def log(msg):
        print(f"[gpu_peers {time.perf_counter() - start:7.1f} s] {msg}", file=sys.stderr, flush=True)
    return log


def machine(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} processors)"


def git_commit():
    try:
        done = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def run_preset(preset, args, ctx, log, rows, save):
    """Runs every chosen peer on one preset, appending to rows and saving the reports after each peer."""
    specs = args.manifests[preset]
    dtype_of = (lambda s: DTYPES[args.param_dtype]) if args.param_dtype else (lambda s: DTYPES[s.dtype])
    values = sum(s.numel for s in specs)
    log(f"preset {preset}: {len(specs)} parameters, {values / 1e6:.1f}M values, "
        f"{sum(s.algorithm == 'normuon' for s in specs)} matrices on NorMuon")
    by_name = {p.name: p for p in PEERS}
    for peer in (by_name[name] for name in args.peer_list):  # in --peers order: the ones that matter most first
        plan = Plan(warmup=args.slow_warmup if peer.slow else args.warmup,
                    steps=args.slow_steps if peer.slow else args.steps, profile_steps=args.profile_steps)
        log(f"{peer.name}: {plan.warmup} warm-up + {plan.steps} measured + {plan.profile_steps} profiled steps")
        if peer.external:
            t0 = time.perf_counter()
            dtype = args.param_dtype or specs[0].dtype
            got = run_fused_cpp(args.cli, preset, specs, ctx.device, dtype, plan.warmup, plan.steps, args.seed)
            log(f"{peer.name}: {got[0].status} in {time.perf_counter() - t0:.1f} s"
                + (f" ({got[0].reason})" if got[0].reason else ""))
            rows += got
        else:
            rows.append(run_python_peer(peer, preset, specs, ctx, dtype_of, plan, args.seed, log))
        save(f"stopped after {preset}: {peer.name}")


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    log = log_to_stderr()
    command = shlex.join([os.path.basename(sys.executable), os.path.relpath(os.path.abspath(__file__), REPO),
                          *(sys.argv[1:] if argv is None else argv)])
    where = machine(args.device)
    if args.device.type == "cpu":  # every peer on the same threads
        torch.set_num_threads(args.threads)
        where += f", {args.threads} threads for every peer"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (f"device {where}; torch {torch.__version__}; Python {platform.python_version()}; "
              f"normuon {normuon.__version__} (_C: {'yes' if normuon.native_available() else 'no'}); {date}")
    log(header)
    ctx = Context(device=args.device, official_path=args.official_normuon, dion_src=args.dion_src,
                  threads=args.threads or 0)
    measure.warm_up_device(args.device)
    rows = []
    commit = git_commit()

    def save(partial=None):
        """Writes the reports from the rows so far: a run cut short by a time limit keeps what it measured."""
        report.add_speedups(rows)
        if args.csv:
            write_atomic(args.csv, report.csv_text(rows, where, torch.__version__))
        if args.markdown:
            write_atomic(args.markdown, markdown(args, rows, where, date, commit, command, partial))

    for preset in args.presets:
        run_preset(preset, args, ctx, log, rows, save)
    save()
    for path in (args.csv, args.markdown):
        if path:
            log(f"wrote {path}")
    print(report.text_report(rows, args.presets, f"{header}\ncommand: {command}"))
    return 0


def markdown(args, rows, where, date, commit, command, partial):
    """The self-contained markdown report; `partial` says where an unfinished run stands."""
    sections = [f"## {p}\n\n{report.markdown_table([r for r in rows if r.preset == p])}\n" for p in args.presets]
    note = [f"**Incomplete run** ({partial}): the tables hold the peers measured so far.", ""] if partial else []
    return "\n".join([
        "# Optimizer peers: old vs new on one device", "", *note,
        f"* device: {where}", f"* torch {torch.__version__}, Python {platform.python_version()}, "
        f"normuon {normuon.__version__} (native module: {'yes' if normuon.native_available() else 'no'})",
        f"* date: {date}", f"* git commit: {commit or 'unknown'}", "* command:", "",
        "```sh", command, "```", "",
        "Every peer steps the same model with the same gradients (set once, reused by every step) and the "
        "same hyper-parameters: NorMuon lr 0.02, momentum 0.95, beta2 0.95, weight_decay 0; AdamW lr 3e-4, "
        "betas (0.9, 0.95), eps 1e-10, weight_decay 0. Routing: docs/spec.md section 2.", "",
        *sections, "## What the columns count", "", report.DEFINITIONS, "",
        "## Peers", "", *[f"* `{p.name}`: {p.what}" for p in PEERS if p.name in args.peer_list], ""])


if __name__ == "__main__":
    sys.exit(main())
