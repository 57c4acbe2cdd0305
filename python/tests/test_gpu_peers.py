"""bench/gpu_peers.py on the CPU (the smoke run of the GPU benchmark): a row per requested peer, a peer
that cannot run is reported with the reason, bad arguments exit 2 and write nothing. Plus the two pieces
that only a GPU exercises end to end: counting profiler events and importing bench-cuda's CSV."""
import csv
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")

from conftest import cli_path, require_native  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPT = BENCH / "gpu_peers.py"
PEERS = ["official", "torch-muon", "emerging-adaptive-muon", "reference", "fused-py", "fused-cpp"]


def run(*args):
    env = {k: v for k, v in os.environ.items() if k != "NORMUON_BACKEND"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run([sys.executable, str(SCRIPT), "--cli", cli_path(), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    require_native()
    out = tmp_path_factory.mktemp("gpu_peers")
    done = run("--device", "cpu", "--preset", "tiny", "--steps", 1, "--warmup", 0, "--profile-steps", 1,
               "--threads", 1, "--peers", ",".join(PEERS), "--official-normuon", out / "no-such-normuon.py",
               "--csv", out / "peers.csv", "--markdown", out / "peers.md")
    assert done.returncode == 0, done.stdout + done.stderr
    with open(out / "peers.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return done, rows, (out / "peers.md").read_text()


def test_a_row_per_requested_peer(smoke):
    done, rows, markdown = smoke
    assert [r["peer"] for r in rows] == PEERS  # on the CPU fused-cpp has one row (no graph)
    table = done.stdout.splitlines()
    for peer in PEERS:
        assert any(line.startswith(peer + " ") for line in table), f"no table line for {peer}:\n{done.stdout}"
        assert f"| {peer} |" in markdown
    by = {r["peer"]: r for r in rows}
    for peer in ("reference", "fused-py", "fused-cpp"):  # the project's own peers run everywhere
        assert by[peer]["status"] == "ok", by[peer]
        assert float(by[peer]["step_ms_median"]) > 0
    assert float(by["fused-py"]["speedup_vs_reference"]) > 0
    assert "backend fast-cpu" in by["fused-py"]["notes"]
    for peer in PEERS:  # whatever could not run says why
        assert by[peer]["status"] in ("ok", "skipped", "failed")
        assert (by[peer]["status"] == "ok") != bool(by[peer]["reason"]), by[peer]
    assert "command:" in markdown and "--preset tiny" in markdown and "What the columns count" in markdown
    assert "1 threads for every peer" in done.stdout and "1 threads for every peer" in markdown


def test_a_missing_peer_is_skipped_with_the_reason(smoke):
    done, rows, _ = smoke
    by = {r["peer"]: r for r in rows}
    assert by["official"]["status"] == "skipped"
    assert "no-such-normuon.py not found" in by["official"]["reason"]
    if not hasattr(torch.optim, "Muon"):
        assert by["torch-muon"]["status"] == "skipped" and "torch.optim.Muon" in by["torch-muon"]["reason"]
    assert "SKIPPED: " in done.stdout


@pytest.mark.parametrize("args, word", [(["--preset", "no-such-preset"], "no-such-preset"),
                                        (["--peers", "fused-py,no-such-peer"], "no-such-peer"),
                                        (["--steps", "0"], "--steps"),
                                        (["--threads", "0"], "--threads")])
def test_bad_arguments_exit_2_and_write_nothing(tmp_path, args, word):
    done = run("--device", "cpu", "--preset", "tiny", *args, "--csv", tmp_path / "x.csv",
               "--markdown", tmp_path / "x.md")
    assert done.returncode == 2, done.stdout + done.stderr
    assert word in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_help_explains_peers_and_metrics():
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for word in PEERS + ["--slow-steps", "launch API", "syncs", "extra MiB", "no CUDA-graph row for the Python path"]:
        assert word in " ".join(done.stdout.split())


def _ours(name):
    return name == "gpu_peers" or name == "peers" or name.startswith("peers.")


@pytest.fixture
def bench_modules(monkeypatch):
    """bench/ on sys.path for the test and its modules (gpu_peers, peers, peers.*) imported afresh; afterwards
    sys.path and sys.modules are as they were."""
    monkeypatch.syspath_prepend(str(BENCH))
    for name in [n for n in sys.modules if _ours(n)]:
        monkeypatch.delitem(sys.modules, name)  # put back when the test ends
    yield lambda name: importlib.import_module(name)
    for name in [n for n in sys.modules if _ours(n)]:  # runs before monkeypatch's undo
        del sys.modules[name]


def test_count_events_per_step(bench_modules):
    m = bench_modules("peers.counts")
    Ev = m.Ev
    events = [  # two steps on thread 1; a cudaDeviceSynchronize between them (outside the ranges)
        Ev(m.MARK, False, 1, 0, 100, True), Ev(m.MARK, False, 1, 200, 300, True),
        Ev(m.MARK, True, 0, 0, 100, True),  # the range's GPU mirror: not a kernel
        Ev("aten::copy_", False, 1, 10, 40, False), Ev("aten::to", False, 1, 10, 30, False),
        Ev("aten::copy_", False, 1, 15, 25, False), Ev("cudaLaunchKernel", False, 1, 16, 18, False),
        Ev("aten::_version", False, 1, 41, 42, False),
        Ev("cudaMemcpyAsync", False, 1, 50, 51, False), Ev("cudaStreamSynchronize", False, 1, 52, 60, False),
        Ev("cudaLaunchKernelExC_v11060", False, 1, 210, 211, False), Ev("cuLaunchKernel", False, 1, 220, 221, False),
        Ev("aten::mul_", False, 1, 230, 240, False),
        Ev("cudaDeviceSynchronize", False, 1, 150, 160, False),
        Ev("void kernel<float>(float*)", True, 7, 20, 30, False),
        Ev("Memcpy DtoH (Device -> Pageable)", True, 7, 55, 56, False),
        Ev("Memset (Device)", True, 7, 215, 216, False), Ev("nvjet_hsh_128x256", True, 7, 230, 260, False),
    ]
    c = m.count_events(events, 2)
    assert c == dict(kernels=1.0, memcpy=0.5, memset=0.5, d2h=0.5, launch_api=1.5, syncs=0.5, aten_top=1.0,
                     aten_all=2.0)


def test_bench_cuda_csv_import(bench_modules):
    cli_peer = bench_modules("peers.cli_peer")
    rows = [dict(model="gpt-1.3b", phase="step", metric=k, value=str(v), unit="")
            for k, v in dict(fast_eager_ms_median=10, fast_eager_ms_min=9, fast_eager_ms_max=11,
                             fast_graph_ms_median=8, fast_graph_ms_min=7.5, fast_graph_ms_max=9,
                             fast_eager_timed_ms_median=12, fast_eager_timed_ms_min=12, fast_eager_timed_ms_max=13,
                             launches_per_step_eager=400, graph_kernel_nodes=420, graph_launches_per_step=1).items()]
    eager, wait, graph = cli_peer.cuda_rows(rows)
    assert (eager["step_ms"].median, eager["step_ms"].min, eager["step_ms"].max) == (10, 9, 11)
    assert wait["variant"] == "wait" and wait["step_ms"].median == 12
    assert eager["counts"] == {"launch_api": 400} and graph["variant"] == "graph"
    assert graph["counts"] == {"launch_api": 1, "kernels": 420} and graph["step_ms"].median == 8


def test_a_run_cut_short_keeps_the_peers_it_measured(tmp_path, monkeypatch, bench_modules):
    # A KeyboardInterrupt at fused-py stands in for a run stopped part-way (a time limit, Ctrl-C): the reports
    # are rewritten after every peer, so what was measured before the stop survives.
    require_native()
    gpu_peers = bench_modules("gpu_peers")
    real = bench_modules("peers.run").run_python_peer

    def stop_at_fused(peer, *a, **kw):
        if peer.name == "fused-py":
            raise KeyboardInterrupt
        return real(peer, *a, **kw)

    monkeypatch.setattr(gpu_peers, "run_python_peer", stop_at_fused)
    monkeypatch.setenv("NORMUON_CLI", cli_path())
    md, table = tmp_path / "peers.md", tmp_path / "peers.csv"
    with pytest.raises(KeyboardInterrupt):
        gpu_peers.main(["--device", "cpu", "--preset", "tiny", "--steps", "1", "--warmup", "0", "--cli", cli_path(),
                        "--peers", "reference,fused-py", "--csv", str(table), "--markdown", str(md)])
    text = md.read_text()
    assert "Incomplete run" in text and "reference" in text, text
    with open(table, newline="") as f:
        assert [r["peer"] for r in csv.DictReader(f)] == ["reference"]


def test_banks_stack_the_experts_and_both_layouts_run(bench_modules):
    """--banks: a preset's experts stacked into [E, m, n] banks where the first expert stood; fused-py steps the
    banks, fused-py-2d their experts as 2-D parameters; experts not numbered 0, 1, ... are refused."""
    require_native()
    model, optimizers, run_mod = (bench_modules(n) for n in ("peers.model", "peers.optimizers", "peers.run"))
    Spec = model.Spec
    specs = ([Spec("l.attn.weight", (8, 8), "f32", "matrix", "normuon")]
             + [Spec(f"l.mlp.experts.{k}.{p}.weight", (6, 8) if p == "up" else (8, 6), "f32", "matrix", "normuon")
                for k in range(3) for p in ("up", "down")]
             + [Spec("l.norm.weight", (8,), "f32", "norm", "adamw")])
    banks = model.bank_specs(specs)
    assert [(s.name, s.shape, s.role, s.algorithm) for s in banks] == [
        ("l.attn.weight", (8, 8), "matrix", "normuon"), ("l.mlp.experts.up", (3, 6, 8), "experts", "normuon"),
        ("l.mlp.experts.down", (3, 8, 6), "experts", "normuon"), ("l.norm.weight", (8,), "norm", "adamw")]
    with pytest.raises(model.ManifestError, match="not numbered 0, 1"):
        model.bank_specs([s for s in specs if ".experts.1." not in s.name])
    ctx = optimizers.Context(device=torch.device("cpu"), official_path="", dion_src="", threads=1)
    by = {p.name: p for p in optimizers.PEERS}
    plan = run_mod.Plan(warmup=1, steps=1, profile_steps=0)
    for name in ("fused-py", "fused-py-2d"):
        row = run_mod.run_python_peer(by[name], "t", banks, ctx, lambda s: torch.float32, plan, 1, lambda m: None)
        assert row.status == "ok", row.reason
    row = run_mod.run_python_peer(by["fused-py-2d"], "t", specs, ctx, lambda s: torch.float32, plan, 1, lambda m: None)
    assert row.status != "ok" and "no expert banks" in row.reason, row
