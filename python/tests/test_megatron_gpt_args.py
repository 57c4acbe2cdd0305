"""bench/megatron_gpt.py's argument checks, which run before megatron-core is imported (so here too)."""
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "megatron_gpt.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_a_warm_up_as_long_as_the_run_is_refused_up_front():
    # Megatron's scheduler asserts warm-up < decay (= --iters): a bare AssertionError from inside the run.
    done = run("--iters", "2")  # the default --lr-warmup-iters is 2
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--lr-warmup-iters must be in [0, --iters - 1] = [0, 1]" in done.stderr, done.stderr
    done = run("--iters", "5", "--lr-warmup-iters", "-1")
    assert done.returncode == 2 and "--lr-warmup-iters must be" in done.stderr, done.stderr
