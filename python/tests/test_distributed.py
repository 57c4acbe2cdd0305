"""DistributedNorMuonAdamW, NorMuonAdamW(process_group=) under its old name (docs/distributed.md): multi-process
runs over Gloo on the CPU, compared bit for bit with the single-process NorMuonAdamW on the same gradients.

Two launches (2 and 3 ranks, spawned, FileStore rendezvous in a temporary folder) run every scenario;
each rank saves what it saw, and the tests below compare that with single-process runs made here."""
import math
import os
from functools import partial

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with Gloo is not available", allow_module_level=True)

from torch import nn  # noqa: E402

import normuon  # noqa: E402
from conftest import fill_grads, make_model, params_of, require_native, run_gloo_ranks  # noqa: E402
from normuon.distributed import DistributedNorMuonAdamW  # noqa: E402
from normuon.sharded import _comm_device, _object_group, assign_owners, newton_schulz_flops  # noqa: E402

STEPS = 4
VARIANTS = {
    # name: (model dtype, backend, scheduler, optimizer keywords)
    "ref_fp32": (None, "reference", False, dict(weight_decay=0.1, adamw_weight_decay=0.05)),
    "fast_fp32": (None, "fast", False, dict(weight_decay=0.1, adamw_weight_decay=0.05)),
    "fast_fp32_sched": (None, "fast", True, dict(weight_decay=0.1, adamw_weight_decay=0.05,
                                                 reduce_axis="longer_dim", weight_decay_mode="cautious",
                                                 # stored [in, out]: a wide matrix and a square one
                                                 transposed={"blocks.*.mlp_fc.weight": True,
                                                             "blocks.*.proj.weight": True})),
    "fast_bf16": (torch.bfloat16, "fast", False, dict(weight_decay=0.1, adamw_betas=(0.0, 0.95))),
}


class TwoMatrices(nn.Module):
    """Two NorMuon matrices, so a third rank owns none; with_adamw adds an embedding and a bias."""

    def __init__(self, with_adamw):
        super().__init__()
        torch.manual_seed(5)
        if with_adamw:
            self.embed = nn.Embedding(16, 8)
        self.fc1 = nn.Linear(8, 24, bias=with_adamw)
        self.fc2 = nn.Linear(24, 8, bias=False)


def build(variant, distributed, seed=1):
    dtype, backend, scheduler, kw = VARIANTS[variant]
    model = make_model(seed=seed, dtype=dtype)
    if distributed:
        opt = DistributedNorMuonAdamW(model.named_parameters(), backend=backend, threads=1, **kw)
    else:
        opt = normuon.NorMuonAdamW(model.named_parameters(), backend=backend, threads=1, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 / (1 + 0.5 * i)) if scheduler else None
    return model, opt, sched


def train(model, opt, sched, first, last):
    """Missing gradients on a rotating parameter, and at step 2 on every AdamW parameter (its group's step
    lags behind NorMuon's, which the bias corrections see)."""
    names = [n for n, _ in model.named_parameters()]
    adamw = {n for n, p in model.named_parameters() if p.dim() != 2 or n.startswith(("wte", "wpe", "lm_head", "embed"))}
    for step in range(first, last + 1):
        fill_grads(model, step, skip=adamw if step == 2 else {names[step % len(names)]})
        opt.step()
        if sched is not None:
            sched.step()


def record(model, opt):
    out = dict(params=params_of(model), state=opt.state_dict())
    if isinstance(opt, DistributedNorMuonAdamW):
        out.update(comm=dict(opt.comm_stats), last=dict(opt.last_step_comm), owners=opt.ownership_table(),
                   owned=opt.owned_names())
    return out


# ------------------------------------------------------------------------------------ the rank jobs


def job_train(variant, world, rank, out):
    model, opt, sched = build(variant, True)
    train(model, opt, sched, 1, STEPS)
    return record(model, opt)


def job_save(world, rank, out):
    """3 steps, the state file and state dict, then 2 more steps (saving must not disturb the run)."""
    model, opt, _ = build("fast_fp32", True)
    train(model, opt, None, 1, 3)
    opt.export_state(os.path.join(out, f"state-w{world}.safetensors"))
    saved = dict(sd=opt.state_dict(), params=params_of(model))
    train(model, opt, None, 4, 5)
    return dict(saved=saved, final=record(model, opt))


def job_resume_file(path, world, rank, out):
    model, opt, _ = build("fast_fp32", True, seed=99)  # other initial values: the file must set them
    opt.import_state(os.path.join(out, path))
    train(model, opt, None, 4, 5)
    return record(model, opt)


def job_resume_sd(world, rank, out):
    saved = torch.load(os.path.join(out, "w2-r0.pt"))["save"]["saved"]
    model, opt, _ = build("fast_fp32", True, seed=99)
    with torch.no_grad():  # load_state_dict, as in torch, leaves the model's parameters to the caller
        for name, p in model.named_parameters():
            p.copy_(saved["params"][name])
    opt.load_state_dict(saved["sd"])
    train(model, opt, None, 4, 5)
    return record(model, opt)


def job_bad_load(world, rank, out):
    """A state file of another model: every rank refuses it and nothing changes."""
    model, opt, _ = build("fast_fp32", True)
    train(model, opt, None, 1, 1)
    before = record(model, opt)
    try:
        opt.import_state(os.path.join(out, "state-two.safetensors"))
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return dict(error=error, before=before, after=record(model, opt))


def job_nonfinite(world, rank, out):
    model, opt, _ = build("fast_fp32", True)
    train(model, opt, None, 1, 1)
    victim = [r["name"] for r in opt.ownership_table() if r["algorithm"] == "normuon" and r["owner"] == world - 1][0]
    result = dict(victim=victim)
    poison_grads(model, victim)
    try:
        opt.step()
    except RuntimeError as exc:
        result["error"] = str(exc)
    opt.nonfinite = "skip_step"
    opt.step()
    result.update(skip=opt.last_skip_reason, after_skip=record(model, opt))
    opt.nonfinite = "error"
    train(model, opt, None, 2, 2)
    result["final"] = record(model, opt)
    return result


def poison_grads(model, victim):
    """Step-2 gradients with a NaN in `victim` and an Inf in the head (later in manifest order)."""
    fill_grads(model, 2)
    named = dict(model.named_parameters())
    named[victim].grad.view(-1)[5] = float("nan")
    named["lm_head.weight"].grad.view(-1)[0] = float("inf")


def job_two_matrices(with_adamw, world, rank, out):
    model = TwoMatrices(with_adamw)
    opt = DistributedNorMuonAdamW(model.named_parameters(), threads=1, weight_decay=0.1)
    train(model, opt, None, 1, STEPS)
    if with_adamw:
        opt.export_state(os.path.join(out, "state-two.safetensors"))
    return record(model, opt)


def job_side_group(world, rank, out):
    """The objects (a state file's outcome) over a Gloo group of their own, as under NCCL: save at step 3,
    resume in a new optimizer, 2 more steps."""
    model, opt, _ = build("fast_fp32", True)
    opt._shards.object_group = _object_group(None, "nccl")  # what an NCCL-only world gets
    assert dist.get_backend(opt._shards.object_group) == "gloo" and opt._shards.object_group is not dist.group.WORLD
    train(model, opt, None, 1, 3)
    path = os.path.join(out, f"state-side-w{world}.safetensors")
    opt.export_state(path)
    saved = dict(params=params_of(model), state=opt.state_dict())
    model, opt, _ = build("fast_fp32", True, seed=99)
    opt._shards.object_group = _object_group(None, "nccl")
    opt.import_state(path)
    train(model, opt, None, 4, 5)
    return dict(saved=saved, final=record(model, opt))


FROZEN = "blocks.1.mlp_fc.weight"


def frozen_run(distributed, first, last, seed=1, load=None):
    """Steps first..last of a model with a frozen matrix that never has a gradient (one process leaves it
    out of its layout), after loading a state file if given."""
    model = make_model(seed=seed)
    model.get_parameter(FROZEN).requires_grad_(False)
    cls = DistributedNorMuonAdamW if distributed else normuon.NorMuonAdamW
    opt = cls(model.named_parameters(), threads=1, weight_decay=0.1)
    if load is not None:
        opt.import_state(load)
    for step in range(first, last + 1):
        fill_grads(model, step, skip={FROZEN})
        opt.step()
    return model, opt


def job_frozen(world, rank, out):
    """The ranks' state file of that model after steps 1-2, and one process's file resumed for step 3."""
    _, opt = frozen_run(True, 1, 2)
    opt.export_state(os.path.join(out, f"frozen-w{world}.safetensors"))
    model, _ = frozen_run(True, 3, 3, seed=99, load=os.path.join(out, "frozen-single.safetensors"))
    return params_of(model)


def job_missing_file(world, rank, out):
    """Rank 1 cannot read the file (a path not on its node): every rank raises, none waits in a
    collective, nothing changes."""
    model, opt, _ = build("fast_fp32", True)
    train(model, opt, None, 1, 1)
    before = record(model, opt)
    path = os.path.join(out, "state-w2.safetensors") if rank == 0 else os.path.join(out, "not-there.safetensors")
    try:
        opt.import_state(path)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return dict(error=error, before=before, after=record(model, opt))


def jobs_for(world):
    """The jobs of one launch, run in this order (world 3 reads what world 2 wrote)."""
    jobs = {f"train:{v}": partial(job_train, v) for v in VARIANTS}
    if world == 2:
        jobs.update(save=job_save, resume_single=partial(job_resume_file, "state-single.safetensors"),
                    nonfinite=job_nonfinite, frozen=job_frozen, missing_file=job_missing_file)
    else:
        jobs.update({"repeat:fast_bf16": partial(job_train, "fast_bf16"),
                     "resume_file": partial(job_resume_file, "state-w2.safetensors"),
                     "resume_sd": job_resume_sd,
                     "two": partial(job_two_matrices, True),
                     "two_bare": partial(job_two_matrices, False),
                     "bad_load": job_bad_load,
                     "side_group": job_side_group})
    return jobs


def rank_jobs(world, rank, out):
    return {name: job(world, rank, out) for name, job in jobs_for(world).items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{world: [results of rank 0, rank 1, ...]} of the two launches."""
    require_native()
    out = str(tmp_path_factory.mktemp("distributed"))
    model, opt, _ = build("fast_fp32", False)  # a single-process file for the world-2 run to resume
    train(model, opt, None, 1, 3)
    opt.export_state(os.path.join(out, "state-single.safetensors"))
    _, opt = frozen_run(False, 1, 2)
    opt.export_state(os.path.join(out, "frozen-single.safetensors"))
    runs = {"out": out}
    for world in (2, 3):
        runs[world] = run_gloo_ranks(rank_jobs, world, out)
    return runs


# ------------------------------------------------------------------------------------ comparisons


def single(variant, last=STEPS):
    """The single-process run, with the workers' one torch thread: torch's own bf16 matmuls (the model's
    forward and backward) sum in an order that follows its thread count where oneDNN has no bf16 kernel
    (ONEDNN_MAX_CPU_ISA=AVX2), and the gradients must be the workers'."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, opt, sched = build(variant, False)
        train(model, opt, sched, 1, last)
        return record(model, opt)
    finally:
        torch.set_num_threads(threads)


def assert_same(got, want):
    """Parameters and the whole state dict, bit for bit; group steps and hyper-parameters equal."""
    assert got["params"].keys() == want["params"].keys()
    for name in want["params"]:
        assert torch.equal(got["params"][name], want["params"][name]), name
    gs, ws = got["state"], want["state"]
    assert gs["param_groups"] == ws["param_groups"]
    assert gs["state"].keys() == ws["state"].keys()
    for i, s in ws["state"].items():
        assert gs["state"][i].keys() == s.keys()
        for k, t in s.items():
            assert torch.equal(gs["state"][i][k], t), (i, k)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_rank_equals_single_process(runs, world, variant):
    want = single(variant)
    for rank, results in enumerate(runs[world]):
        assert_same(results[f"train:{variant}"], want)


def test_matrices_are_spread_and_exchanged_in_one_collective(runs):
    for world in (2, 3):
        for variant in VARIANTS:
            rank_results = [r[f"train:{variant}"] for r in runs[world]]
            owners = rank_results[0]["owners"]
            matrices = [r for r in owners if r["algorithm"] == "normuon"]
            assert {r["owner"] for r in matrices} == set(range(world))
            assert {r["owner"] for r in owners if r["algorithm"] == "adamw"} == {"all"}
            # Counted bytes: the 24-byte verdict, then each owner's new matrices to every other rank (every
            # rank holds the parameters and gradients whole: nothing goes in), but for the one that had no
            # gradient in the last step.
            idle = [n for n, _ in make_model().named_parameters()][STEPS % len(owners)]
            numel = [sum(math.prod(r["shape"]) for r in matrices if r["owner"] == k and r["name"] != idle)
                     for k in range(world)]
            for rank, res in enumerate(rank_results):
                assert res["owned"] == [r["name"] for r in matrices if r["owner"] == rank]
                assert res["last"] == dict(collectives=2, bytes_sent=24 + 4 * (world - 1) * numel[rank],
                                           bytes_received=24 + 4 * (sum(numel) - numel[rank]))
                # In all: the steps' and the state dict's (record), which last_step_comm leaves out.
                assert res["comm"]["steps"] == STEPS and res["comm"]["collectives"] == 2 * STEPS + 1


def test_rank_that_owns_no_matrix(runs):
    for job, with_adamw in (("two", True), ("two_bare", False)):
        model = TwoMatrices(with_adamw)
        opt = normuon.NorMuonAdamW(model.named_parameters(), threads=1, weight_decay=0.1)
        train(model, opt, None, 1, STEPS)
        want = record(model, opt)
        for rank, results in enumerate(runs[3]):
            assert_same(results[job], want)
            owners = results[job]["owners"]
            assert [r["owner"] for r in owners if r["algorithm"] == "normuon"] == [0, 1]
        assert runs[3][2][job]["owned"] == []  # rank 2 owns nothing: it sends its verdict only
        assert runs[3][2][job]["last"]["bytes_sent"] == 24


def test_run_to_run_bitwise(runs):
    for results in runs[3]:
        a, b = results["train:fast_bf16"], results["repeat:fast_bf16"]
        assert_same(a, b)


def test_save_resume_and_reshard(runs):
    want = single("fast_fp32", last=5)
    for results in runs[2]:
        assert_same(results["save"]["final"], want)          # saving does not disturb the run
        assert_same(results["resume_single"], want)          # 1 process -> 2 ranks
    for results in runs[3]:
        assert_same(results["resume_file"], want)            # 2 ranks -> 3 ranks, state file
        assert_same(results["resume_sd"], want)              # 2 ranks -> 3 ranks, state dict
    # 2 ranks -> 1 process: the file is the single-process file.
    model, opt, _ = build("fast_fp32", False, seed=99)
    opt.import_state(os.path.join(runs["out"], "state-w2.safetensors"))
    train(model, opt, None, 4, 5)
    assert_same(record(model, opt), want)
    header = normuon._C.read_state_header(os.path.join(runs["out"], "state-w2.safetensors"))
    assert header["backend"] == "fast-cpu"


def test_objects_over_a_side_group(runs):
    want_saved, want_final = single("fast_fp32", last=3), single("fast_fp32", last=5)
    for results in runs[3]:
        assert_same(results["side_group"]["saved"], want_saved)
        assert_same(results["side_group"]["final"], want_final)


def test_bad_state_file_is_refused_everywhere(runs):
    errors = {results["bad_load"]["error"] for results in runs[3]}
    assert len(errors) == 1 and errors != {None}
    assert "StateFileError" in errors.pop()
    for results in runs[3]:
        assert_same(results["bad_load"]["after"], results["bad_load"]["before"])


def test_nonfinite_gradient(runs):
    victim = runs[2][0]["nonfinite"]["victim"]
    model, opt, _ = build("fast_fp32", False)
    train(model, opt, None, 1, 1)
    poison_grads(model, victim)
    with pytest.raises(RuntimeError) as caught:
        opt.step()
    opt.nonfinite = "skip_step"
    opt.step()
    skip, after_skip = opt.last_skip_reason, record(model, opt)
    opt.nonfinite = "error"
    train(model, opt, None, 2, 2)
    assert victim in str(caught.value) and "nan" in str(caught.value)
    for results in runs[2]:
        got = results["nonfinite"]
        assert got["error"] == str(caught.value)
        assert got["skip"] == skip
        assert_same(got["after_skip"], after_skip)
        assert_same(got["final"], record(model, opt))


# ------------------------------------------------------------------------------------ in-process


def test_owner_assignment_rule():
    owners, loads = assign_owners([5, 9, 9, 1, 4], 2)
    # sorted (cost desc, index): 9@1 -> r0, 9@2 -> r1, 5@0 -> r0 (tie 9/9: rank 0), 4@4 -> r1, 1@3 -> r1
    assert owners == [0, 0, 1, 1, 1] and loads == [14, 14]
    assert assign_owners([3, 3], 3) == ([0, 1], [3, 3, 0])  # more ranks than items: rank 2 owns nothing
    assert assign_owners([], 2) == ([], [0, 0])
    expected = 5 * (4 * 256 ** 2 * 768 + 2 * 256 ** 3)
    assert newton_schulz_flops(768, 256, 5) == newton_schulz_flops(256, 768, 5) == expected
    # The tiny preset's 16 matrices: within 10% of perfect balance at every world size up to 4.
    shapes = [(768, 256), (256, 256), (1024, 256), (256, 1024)] * 4
    costs = [newton_schulz_flops(r, c, 5) for r, c in shapes]
    for world in (2, 3, 4):
        _, loads = assign_owners(costs, world)
        assert max(loads) <= 1.10 * sum(costs) / world


def test_owner_cost_follows_ns_algorithm():
    """The owners' cost is ns_dense_flops of core/include/normuon/ns_algorithm.h for either algorithm: the
    formulas written out by hand (a = min side, b = max side; gram restarts before iterations 2, 5, ...),
    and the C++ count itself where the native module is built."""
    a, b = 256, 768
    standard = {steps: steps * (4 * a * a * b + 2 * a ** 3) for steps in (1, 2, 3, 5, 8)}
    gram = {1: 4 * a * a * b + 2 * a ** 3, 2: 4 * a * a * b + 10 * a ** 3, 3: 8 * a * a * b + 12 * a ** 3,
            5: 8 * a * a * b + 28 * a ** 3, 8: 12 * a * a * b + 46 * a ** 3}
    for steps in standard:
        for rows, cols in ((a, b), (b, a)):
            assert newton_schulz_flops(rows, cols, steps) == standard[steps]
            assert newton_schulz_flops(rows, cols, steps, "standard") == standard[steps]
            assert newton_schulz_flops(rows, cols, steps, "gram") == gram[steps], (rows, cols, steps)
        # A square matrix takes the standard iteration under gram too.
        assert newton_schulz_flops(a, a, steps, "gram") == steps * 6 * a ** 3
    assert all(isinstance(newton_schulz_flops(97, 1000, s, "gram"), int) for s in range(1, 12))
    with pytest.raises(ValueError, match="ns_algorithm"):
        newton_schulz_flops(a, b, 5, "fast")
    if normuon.native_available():
        from normuon import _C
        shapes = [(256, 768), (768, 256), (2048, 8192), (97, 1000), (1, 64), (512, 512)]
        for algorithm in ("standard", "gram"):
            for rows, cols in shapes:
                for steps in range(1, 12):
                    assert newton_schulz_flops(rows, cols, steps, algorithm) == _C.ns_dense_flops(
                        algorithm, rows, cols, steps), (algorithm, rows, cols, steps)


def test_owners_are_balanced_by_the_gram_cost():
    """Under gram a wide matrix costs far less against a square one than under standard: balancing by the
    standard count would overload the rank holding the square matrix and a wide one."""
    shapes = [(512, 512), (256, 2048), (256, 2048), (256, 2048)]
    gram = [newton_schulz_flops(r, c, 5, "gram") for r, c in shapes]
    standard = [newton_schulz_flops(r, c, 5) for r, c in shapes]

    def worst_gram_load(owners):
        return max(sum(g for g, o in zip(gram, owners) if o == rank) for rank in range(2))

    by_gram, loads = assign_owners(gram, 2)
    by_standard, _ = assign_owners(standard, 2)
    assert max(loads) == worst_gram_load(by_gram)
    assert worst_gram_load(by_gram) < worst_gram_load(by_standard)


def test_comm_device_follows_the_parameters(monkeypatch):
    """NCCL: the parameters' GPU, which must be the current device; Gloo (or the CPU half of a mixed group):
    the CPU. Checked without a GPU: torch.device objects need none, the current device is patched."""
    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert _comm_device("gloo", cpu) == cpu and _comm_device("gloo", gpu0) == cpu
    assert _comm_device("cpu:gloo,cuda:nccl", cpu) == cpu
    assert _comm_device("nccl", gpu1) == gpu1 and _comm_device("cpu:gloo,cuda:nccl", gpu1) == gpu1
    assert _comm_device("nccl", cpu) == gpu1  # CPU parameters under NCCL alone: the current device
    for backend in ("nccl", "cpu:gloo,cuda:nccl"):
        with pytest.raises(RuntimeError, match=r"cuda:0.*cuda:1.*torch\.cuda\.set_device\(local_rank\)"):
            _comm_device(backend, gpu0)
    # Only an NCCL-only group needs a side group for the pickled objects.
    for backend in ("gloo", "cpu:gloo,cuda:nccl"):
        assert _object_group(None, backend) is None


def test_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    model = make_model()
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedNorMuonAdamW(model.named_parameters())


@pytest.fixture
def one_rank(tmp_path):
    """A Gloo process group of one rank, in this process, for the test's duration."""
    require_native()
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method="file://" + str(tmp_path / "store"), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_world_of_one(one_rank):
    """One rank: no collectives at all, the single-process result."""
    outcomes = []
    for distributed in (True, False):
        model, opt, sched = build("fast_fp32_sched", distributed)
        train(model, opt, sched, 1, STEPS)
        got = record(model, opt)
        poison_grads(model, "blocks.1.attn.weight")  # left to the local optimizer: same verdict
        with pytest.raises(RuntimeError) as caught:
            opt.step()
        opt.nonfinite = "skip_step"
        opt.step()
        outcomes.append((got, str(caught.value), opt.last_skip_reason, record(model, opt)))
    (got, error, skip, after), (want, want_error, want_skip, want_after) = outcomes
    assert_same(got, want)
    assert_same(after, want_after)
    assert (error, skip) == (want_error, want_skip) and "blocks.1.attn.weight" in error
    assert got["comm"]["collectives"] == 0 and all(r["owner"] in (0, "all") for r in got["owners"])


def test_ownership_cost_uses_the_groups_ns_algorithm(one_rank):
    """Each matrix's cost in the ownership table is its group's Newton-Schulz count, gram included."""
    tables = {}
    for algorithm in ("standard", "gram"):
        model = make_model()
        opt = DistributedNorMuonAdamW(model.named_parameters(), backend="fast", threads=1, ns_algorithm=algorithm)
        shapes = dict(model.named_parameters())
        tables[algorithm] = {r["name"]: r["cost"] for r in opt.ownership_table() if r["algorithm"] == "normuon"}
        for name, cost in tables[algorithm].items():
            rows, cols = shapes[name].shape
            assert cost == newton_schulz_flops(rows, cols, 5, algorithm), name
    assert tables["gram"].keys() == tables["standard"].keys()
    assert any(tables["gram"][n] < tables["standard"][n] for n in tables["gram"])  # some matrix is not square


def test_bad_parameters_get_the_single_process_errors(one_rank):
    """The plan over stand-ins still reports what NorMuonAdamW reports."""
    for params, error, match in (([("w", 3)], TypeError, "not a torch.Tensor"),
                                 ([{"names": ["w"]}], ValueError, "not a dict with 'params'"),
                                 ([], ValueError, "empty parameter list")):
        with pytest.raises(error, match=match):
            DistributedNorMuonAdamW(params)


def test_shard_adamw_is_gone_with_a_warning(one_rank):
    """The old keyword still builds the optimizer (the result is the same), with a warning that says so."""
    with pytest.warns(FutureWarning, match="shard_adamw is gone"):
        opt = DistributedNorMuonAdamW(make_model().named_parameters(), threads=1, shard_adamw=True)
    assert isinstance(opt, normuon.NorMuonAdamW) and opt.owned_names() == [
        r["name"] for r in opt.ownership_table() if r["algorithm"] == "normuon"]
    assert (opt.rank, opt.world_size, opt.process_group) == (0, 1, dist.group.WORLD)  # as the class had them


def test_state_files_leave_a_frozen_matrix_out_as_one_process_does(runs):
    """A parameter frozen and never stepped has no place in one process's state file: the ranks' file is that
    file, so each side resumes the other's (the frozen matrix keeps the resuming model's values)."""
    want = params_of(frozen_run(False, 1, 3)[0])
    resumed = params_of(frozen_run(False, 3, 3, seed=99, load=os.path.join(runs["out"], "frozen-w2.safetensors"))[0])
    for got in [resumed] + [r["frozen"] for r in runs[2]]:
        assert got.keys() == want.keys()
        for name in want:
            if name != FROZEN:
                assert torch.equal(got[name], want[name]), name
        assert torch.equal(got[FROZEN], make_model(seed=99).get_parameter(FROZEN).detach())


def test_a_file_one_rank_cannot_read_is_refused_everywhere(runs):
    got = [r["missing_file"] for r in runs[2]]
    assert got[1]["error"].startswith("StateFileError") and "not-there.safetensors" in got[1]["error"]
    assert got[0]["error"] == (f"RuntimeError: rank 1 could not load the state file "
                               f"{os.path.join(runs['out'], 'state-w2.safetensors')}: {got[1]['error']} "
                               "(nothing was changed)")
    for r in got:
        assert_same(r["after"], r["before"])


def test_an_expert_bank_under_process_group_steps_as_one_process(one_rank):
    """A bank [E, m, n] every rank holds whole (process_group=): its owner steps its experts where the bank lies,
    as one process does."""
    def model_and_opt(**kw):
        torch.manual_seed(9)
        model = nn.Module()
        model.experts = nn.Module()
        model.experts.w1 = nn.Parameter(torch.randn(3, 8, 6))
        model.proj = nn.Linear(6, 6)
        return model, normuon.NorMuonAdamW(model, threads=1, **kw)

    runs = []
    for kw in (dict(process_group=dist.group.WORLD), {}):
        model, opt = model_and_opt(**kw)
        for step in range(1, 3):
            fill_grads(model, step)
            opt.step()
        runs.append((params_of(model), {k: v for k, v in opt.state_dict()["state"][0].items()},
                     [r["algorithm"] for r in opt.routing_table()]))
    (got, got_state, routes), (want, want_state, _) = runs
    assert routes[0] == "normuon"
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert all(torch.equal(got_state[k], want_state[k]) for k in want_state)
    # A NaN in a bank: one process's message, naming the expert and the element inside it.
    reasons = []
    for kw in (dict(process_group=dist.group.WORLD), {}):
        model, opt = model_and_opt(nonfinite="skip_step", **kw)
        fill_grads(model, 1)
        model.experts.w1.grad[1, 2, 3] = float("nan")
        opt.step()
        reasons.append(opt.last_skip_reason)
    assert reasons[0] == reasons[1] and "'experts.w1[1]'" in reasons[0] and "element 15" in reasons[0], reasons
