"""--isolate (the default): each run in a child process of its own, within --time-budget."""
import collections
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from .helpers import SCRIPT
from .plan import new_record, run_plan
from .report import overall_ok, write_outputs


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
    return [sys.executable, SCRIPT] + out + [
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
