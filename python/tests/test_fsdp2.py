"""NorMuonAdamW over FSDP2's sharded parameters (DTensors, Shard(0) on a 1-D mesh): Gloo on the CPU, world
sizes 2 and 4, each rank training on the same batch (so that the reduced gradient is the single process's),
compared bit for bit with NorMuonAdamW in one process: parameters after every step, and the counters."""
import contextlib
import os

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with Gloo is not available", allow_module_level=True)
try:
    from torch.distributed.fsdp import fully_shard
except (ImportError, ValueError):  # torch 1.13: no FSDP2 (its import fails on Python 3.11 with a ValueError)
    pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)", allow_module_level=True)

from torch import nn  # noqa: E402

import normuon  # noqa: E402
from conftest import require_native, run_gloo_ranks  # noqa: E402

STEPS = 3
VARIANTS = {  # name: (parameter dtype, backend, optimizer keywords)
    "fast_fp32": (torch.float32, "fast", dict(weight_decay=0.1, adamw_weight_decay=0.05, ns_precision="fp32")),
    "fast_bf16": (torch.bfloat16, "fast", dict(weight_decay=0.1, reduce_axis="longer_dim")),
    "reference": (torch.float32, "reference", dict(weight_decay=0.1)),
}


class Tiny(nn.Module):
    """An embedding, two hidden matrices of uneven rows (7 and 13: empty and short shards at 4 ranks), a
    norm and a head."""

    def __init__(self, dtype, hidden=13):
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Embedding(11, 6)
        self.up = nn.Linear(6, hidden)
        self.down = nn.Linear(hidden, 7, bias=False)
        self.back = nn.Linear(7, 6, bias=False)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 11, bias=False)
        self.to(dtype)

    def forward(self, x):
        h = self.embed(x)
        h = self.back(torch.relu(self.down(torch.tanh(self.up(h)))))
        return self.head(self.norm(h))


class TinyMoe(nn.Module):
    """An embedding, a mixture of 3 experts stored as banks as transformers 5.x stores them (experts.gate_up_proj
    [E, 2f, d], experts.down_proj [E, d, f]: FSDP2 shards the experts, unevenly at 2 ranks, one rank without any
    at 4), a norm and a head."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(4)
        self.embed = nn.Embedding(11, 6)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.randn(3, 8, 6) * 0.4)
        self.experts.down_proj = nn.Parameter(torch.randn(3, 6, 4) * 0.4)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 11, bias=False)
        self.to(dtype)

    def forward(self, x):
        h = self.embed(x)
        mixed = 0
        for k in range(3):
            gate, up = (h @ self.experts.gate_up_proj[k].t()).chunk(2, dim=-1)
            mixed = mixed + (nn.functional.silu(gate) * up) @ self.experts.down_proj[k].t()
        return self.head(self.norm(h + mixed))


def train_moe(variant, shard, file_out=None):
    """TinyMoe trained for STEPS steps, FSDP2-sharded or in one process: its parameters after every step, the
    counters and the whole state dict at the end; file_out: the project's state file written then."""
    dtype, backend, kw = VARIANTS[variant]
    model = TinyMoe(dtype)
    if shard:
        fully_shard(model)
    opt = normuon.NorMuonAdamW(model, backend=backend, threads=1, **kw)
    seen = []
    for step in range(1, STEPS + 1):
        model(batch(step)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        seen.append({n: (p.full_tensor() if shard else p).detach().clone() for n, p in model.named_parameters()})
    state = {k: {key: t.full_tensor() if shard and key != "step" else t for key, t in s.items()}
             for k, s in opt.state_dict()["state"].items()}
    if file_out is not None:
        opt.export_state(file_out)
    return dict(params=seen, steps=[g["step"] for g in opt.param_groups], state=state,
                owners={r["name"]: r["owner"] for r in opt.ownership_table() or ()}, comm=opt.last_step_comm)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 11, (4, 5), generator=g)


def sharded_tiny(dtype):
    model = Tiny(dtype)
    for m in (model.up, model.down, model.back, model.embed, model.head, model.norm):
        fully_shard(m)
    fully_shard(model)
    return model


def train(variant, shard, first=1, save=None, load=None, whole=None, file_in=None, file_out=None):
    """Steps first..STEPS; save / load: a torch.distributed.checkpoint folder written after step `first`
    - 1... (save: after the step of that number, as (step, folder)); whole: a file with one process's model and
    optimizer state dicts (plain tensors) to start from; file_in / file_out: the project's state file to
    start from / to write at the end."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    dtype, backend, kw = VARIANTS[variant]
    model = sharded_tiny(dtype) if shard else Tiny(dtype)
    opt = normuon.NorMuonAdamW(model, backend=backend, threads=1, **kw)
    if whole is not None:  # one process's state dicts, loaded as they are
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        saved = torch.load(whole)
        set_model_state_dict(model, saved["model"], options=StateDictOptions(full_state_dict=True))
        opt.load_state_dict(saved["optim"])
    if load is not None:  # the state dicts of this world size as templates, filled from the folder
        both = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(both, checkpoint_id=load)
        set_model_state_dict(model, both["model"])
        set_optimizer_state_dict(model, opt, both["optim"])
    if file_in is not None:
        opt.import_state(file_in)
    seen = []
    for step in range(first, STEPS + 1):
        loss = model(batch(step)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen.append({n: (p.full_tensor() if shard else p).detach().clone() for n, p in model.named_parameters()})
        if save is not None and step == save[0]:
            dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                     checkpoint_id=save[1])
    if file_out is not None:
        opt.export_state(file_out)
    return dict(params=seen, steps=[g["step"] for g in opt.param_groups], backend=opt.backend,
                comm=opt.last_step_comm, total=opt.comm_stats, state=None if shard else opt.state_dict()["state"])


def placements_2d():
    """FSDP x TP's mixes on a 2 x 2 mesh: rows by both dimensions (uneven), rows x columns, columns x rows,
    replicated on either dimension."""
    from torch.distributed.tensor import Replicate, Shard

    return {"embed.weight": [Shard(0), Replicate()], "up.weight": [Shard(0), Shard(0)], "up.bias": [Shard(0), Replicate()],
            "down.weight": [Shard(0), Shard(1)], "back.weight": [Replicate(), Shard(1)],
            "norm.weight": [Replicate(), Replicate()], "norm.bias": [Shard(0), Shard(0)],
            "head.weight": [Shard(1), Shard(0)]}


def placed(variant, world, two_d=False):
    """The model's parameters as DTensors, stepped with gradients set by hand (the same on every rank): on a
    1-D mesh replicated (the embedding and 'up', as data-parallel training holds them) or sharded by rows;
    two_d: on a 2 x 2 mesh (placements_2d). world None: plain tensors in one process."""
    dtype, backend, kw = VARIANTS[variant]
    named = list(Tiny(dtype).named_parameters())
    if world is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2, 2) if two_d else (world,))
        place = placements_2d() if two_d else {n: [Replicate()] if n.startswith(("embed", "up")) else [Shard(0)]
                                               for n, _ in named}
        named = [(n, nn.Parameter(distribute_tensor(p.detach(), mesh, place[n]))) for n, p in named]
    opt = normuon.NorMuonAdamW(named, backend=backend, threads=1, **kw)
    seen = []
    for step in range(1, STEPS + 1):
        for k, (n, p) in enumerate(named):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + k)).to(dtype)
            if world is None:
                p.grad = g
            else:  # (norm.weight's gradient arrives replicated: laid out otherwise than its row-sharded parameter)
                p.grad = distribute_tensor(g, p.device_mesh, [Replicate()] if n == "norm.weight" and not two_d
                                           else place[n])
        opt.step()
        seen.append({n: (p if world is None else p.full_tensor()).detach().clone() for n, p in named})
    return dict(params=seen, steps=[g["step"] for g in opt.param_groups])


def banks_on_a_2d_mesh(world):
    """Expert banks as DTensors on a 2 x 2 mesh (world 4; None: plain tensors in one process), gradients set by
    hand: HSDP's (Replicate, Shard(0)) and (Shard(0), Shard(0)) hold whole experts, each rank steps its own;
    (Shard(0), Shard(1)) cuts them, one owner steps the bank."""
    torch.manual_seed(5)
    named = [(n, nn.Parameter(torch.randn(4, 8, 6) * 0.4)) for n in ("experts.hsdp", "experts.apart", "experts.cut")]
    named.append(("mid.weight", nn.Parameter(torch.randn(8, 8))))
    if world is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2, 2))
        place = {"experts.hsdp": [Replicate(), Shard(0)], "experts.apart": [Shard(0), Shard(0)],
                 "experts.cut": [Shard(0), Shard(1)], "mid.weight": [Shard(0), Replicate()]}
        named = [(n, nn.Parameter(distribute_tensor(p.detach(), mesh, place[n]))) for n, p in named]
    opt = normuon.NorMuonAdamW(named, threads=1, weight_decay=0.1, ns_precision="fp32")
    seen = []
    for step in range(1, STEPS + 1):
        for k, (n, p) in enumerate(named):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + k))
            p.grad = g if world is None else distribute_tensor(g, p.device_mesh, p.placements)
        opt.step()
        seen.append({n: (p if world is None else p.full_tensor()).detach().clone() for n, p in named})
    state = {k: {key: t if world is None or key == "step" else t.full_tensor() for key, t in s.items()}
             for k, s in opt.state_dict()["state"].items()}
    return dict(params=seen, steps=[g["step"] for g in opt.param_groups], state=state,
                owners={r["name"]: r["owner"] for r in opt.ownership_table() or ()})


def fsdp_tp_against_one_process():
    """FSDP x TP as torchtitan lays it out (world 4, mesh dp 2 x tp 2: 'up' column-parallel, 'down' row-parallel,
    then fully_shard over dp, which strides the column-parallel rows). TP's split sums make the gradients
    differ from one process's, so the comparison is the optimizer's alone: a single-process NorMuonAdamW
    over the whole parameters, given the whole gradients each step. Returns the steps whose parameters
    differed (none is right)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Tiny(torch.float32, hidden=12)  # TP's forward wants the split dimension even
    twin = {n: p.detach().clone() for n, p in model.named_parameters()}
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for m in (model.up, model.down, model.back, model.embed, model.head, model.norm):
        fully_shard(m, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = normuon.NorMuonAdamW(model, threads=1, weight_decay=0.1, ns_precision="fp32")
    one = normuon.NorMuonAdamW(list(twin.items()), threads=1, weight_decay=0.1, ns_precision="fp32")
    kinds = {n: type(p.placements[0]).__name__ for n, p in model.named_parameters()}
    differed = []
    for step in range(1, STEPS + 1):
        model(batch(step)).pow(2).mean().backward()
        for n, p in model.named_parameters():
            twin[n].grad = p.grad.full_tensor()
        opt.step()
        one.step()
        opt.zero_grad()
        if any(not torch.equal(p.full_tensor(), twin[n]) for n, p in model.named_parameters()):
            differed.append(step)
    return dict(differed=differed, kinds=kinds)


def ddp_train(variant):
    """DDP over plain tensors (every rank holds them whole, with the all-reduced gradients), the optimizer
    told the process group: the same sharded path. Returns the parameters after each step and the final
    state dict (one process's form: plain tensors)."""
    from torch.nn.parallel import DistributedDataParallel

    dtype, backend, kw = VARIANTS[variant]
    model = Tiny(dtype)
    ddp = DistributedDataParallel(model)
    opt = normuon.NorMuonAdamW(model, backend=backend, threads=1, process_group=dist.group.WORLD, **kw)
    seen = []
    for step in range(1, STEPS + 1):
        ddp(batch(step)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        seen.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return dict(params=seen, steps=[g["step"] for g in opt.param_groups], state=opt.state_dict()["state"],
                comm=opt.last_step_comm)


DDP = ("fast_fp32", "reference")  # (Gloo's all-reduce of DDP: fp32)
RESUMED = ("fast_fp32", "fast_bf16")  # saved at world size 2 after step 1, resumed at 4 and 1


def rank_job(world, rank, out):
    if world == 2:
        results = {v: train(v, shard=True, save=(1, os.path.join(out, "dcp-" + v)) if v in RESUMED else None)
                   for v in VARIANTS}
        results.update({"whole_" + v: train(v, shard=True, first=2, whole=os.path.join(out, f"whole-{v}.pt"))
                        for v in RESUMED})
    else:
        results = {v: train(v, shard=True) for v in VARIANTS}
    results.update({"moe_" + v: train_moe(v, shard=True, file_out=os.path.join(out, f"moe-{v}-w{world}.safetensors"))
                    for v in VARIANTS})
    if world != 2:
        results.update({"resumed_" + v: train(v, shard=True, first=2, load=os.path.join(out, "dcp-" + v))
                        for v in RESUMED})
    if world in (2, 4):
        results.update({"ddp_" + v: ddp_train(v) for v in DDP})
        results.update({"file_" + v: train(v, shard=True, first=2, file_in=os.path.join(out, f"whole-{v}.safetensors"),
                                           file_out=os.path.join(out, f"file-{v}-w{world}.safetensors"))
                        for v in RESUMED})
    if world == 4:
        results.update({"2d_" + v: placed(v, world, two_d=True) for v in VARIANTS})
        results["fsdp_tp"] = fsdp_tp_against_one_process()
        results["banks_2d"] = banks_on_a_2d_mesh(world)
    if world == 1:
        return results
    results.update({"placed_" + v: placed(v, world) for v in VARIANTS})
    model = Tiny(torch.float32)
    fully_shard(model.up)
    try:
        normuon.NorMuonAdamW(model)  # sharded and plain parameters mixed
    except ValueError as error:
        results["mixed"] = str(error)
    fully_shard(model)
    if world == 2:
        # bf16: a state dict before any step holds the model's values as masters (the owners' whole
        # copies are filled from the shards when the optimizer is built)
        bf16 = sharded_tiny(torch.bfloat16)
        opt = normuon.NorMuonAdamW(bf16, threads=1)
        state, named = opt.state_dict()["state"], dict(bf16.named_parameters())
        order = [n for g in opt.param_groups for n in g["param_names"]]
        results["masters"] = {n: torch.equal(state[k]["master_param"].full_tensor(), named[n].full_tensor().float())
                              for k, n in enumerate(order)}
        # a gradient on one rank only: every rank refuses the step, nothing changes
        fp32 = sharded_tiny(torch.float32)
        opt = normuon.NorMuonAdamW(fp32, threads=1)
        fp32(batch(1)).pow(2).mean().backward()
        if rank == 1:
            fp32.head.weight.grad = None
        before = [p.full_tensor() for p in fp32.parameters()]
        try:
            opt.step()
        except ValueError as error:
            results["grad_pattern"] = str(error)
        results["unchanged"] = all(torch.equal(a, p.full_tensor()) for a, p in zip(before, fp32.parameters()))
        # a NaN in rank 1's rows of 'down.weight' (rows 4..6 of 7): every rank gets one process's verdict
        for policy in ("error", "skip_step"):
            fp32.zero_grad()
            opt.nonfinite = policy
            fp32(batch(1)).pow(2).mean().backward()
            if rank == 1:
                fp32.down.weight.grad._local_tensor[0, 2] = float("nan")  # element 4 * 13 + 2 of the whole
            try:
                opt.step()
                results["nan_" + policy] = opt.last_skip_reason
            except RuntimeError as error:
                results["nan_" + policy] = str(error)
        results["nan_unchanged"] = all(torch.equal(a, p.full_tensor()) for a, p in zip(before, fp32.parameters()))
    named = list(model.named_parameters())
    try:  # rank 1 leaves a parameter out: every rank is told, none waits in a collective
        normuon.NorMuonAdamW(named[:-1] if rank == 1 else named, threads=1)
    except ValueError as error:
        results["disagree"] = str(error)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_native()
    out = str(tmp_path_factory.mktemp("fsdp2"))
    with one_thread():
        for v in RESUMED:  # one process's state dicts after step 1, for the world-2 ranks to start from
            dtype, backend, kw = VARIANTS[v]
            model = Tiny(dtype)
            opt = normuon.NorMuonAdamW(model, backend=backend, threads=1, **kw)
            model(batch(1)).float().pow(2).mean().backward()
            opt.step()
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, os.path.join(out, f"whole-{v}.pt"))
            opt.export_state(os.path.join(out, f"whole-{v}.safetensors"))
    return dict({world: run_gloo_ranks(rank_job, world, out) for world in (2, 4, 1)}, out=out)  # 2 first: it saves


@contextlib.contextmanager
def one_thread():
    """The workers' thread count, for the single-process runs: torch's own forward and backward sum in an
    order that follows it where oneDNN has no kernel."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def single(variant):
    with one_thread():
        return train(variant, shard=False)


def assert_same(got, one, where, first=1):
    """A rank's run (from step `first`) equals one process's, parameters after every step and counters."""
    assert got["steps"] == one["steps"], (where, got["steps"], one["steps"])
    for step, (a, b) in enumerate(zip(got["params"], one["params"][first - 1:]), start=first):
        for name in b:
            assert torch.equal(a[name], b[name]), (where, step, name, (a[name] - b[name]).abs().max())


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("world", [2, 4])
def test_expert_banks_step_bit_for_bit_as_one_process(runs, world, variant):
    """Banks sharded by FSDP2 along their experts: each rank steps its own experts where they lie (no exchange:
    a step sends only the NaN/Inf verdict's 24 bytes), as one process steps them; the state dict holds the bank's
    state, the state file loads into one process."""
    with one_thread():
        one = train_moe(variant, shard=False)
    for rank, result in enumerate(runs[world]):
        got = result["moe_" + variant]
        assert_same(got, one, (world, rank))
        assert got["state"].keys() == one["state"].keys()
        for k, s in one["state"].items():
            for key, t in s.items():
                assert torch.equal(got["state"][k][key], t), (world, rank, k, key)
        assert got["owners"]["experts.gate_up_proj"] == "all"  # every rank its own experts
        assert (got["comm"]["collectives"], got["comm"]["bytes_sent"]) == (1, 24), got["comm"]
    dtype, backend, kw = VARIANTS[variant]
    with one_thread():
        model = TinyMoe(dtype)
        opt = normuon.NorMuonAdamW(model, backend=backend, threads=1, **kw)
        opt.import_state(os.path.join(runs["out"], f"moe-{variant}-w{world}.safetensors"))
    for k, s in one["state"].items():
        for key, t in s.items():
            assert torch.equal(opt.state_dict()["state"][k][key], t), (world, k, key)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), one["params"][-1][name]), name


def test_banks_on_a_2d_mesh_step_where_their_experts_lie(runs):
    with one_thread():
        one = banks_on_a_2d_mesh(None)
    for rank, got in enumerate(runs[4]):
        got = got["banks_2d"]
        assert_same(got, one, rank)
        for k, s in one["state"].items():
            for key, t in s.items():
                assert torch.equal(got["state"][k][key], t), (rank, k, key)
        assert got["owners"]["experts.hsdp"] == got["owners"]["experts.apart"] == "all", got["owners"]
        assert got["owners"]["experts.cut"] in range(4), got["owners"]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_steps_bit_for_bit_as_one_process(runs, world, variant):
    one = single(variant)
    for rank, result in enumerate(runs[world]):
        assert_same(result[variant], one, (world, rank))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_replicated_and_sharded_parameters_step_as_one_process(runs, variant):
    with one_thread():
        one = placed(variant, None)
    for world in (2, 4):
        for rank, result in enumerate(runs[world]):
            assert_same(result["placed_" + variant], one, (world, rank))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_2x2_mesh_steps_as_one_process(runs, variant):
    with one_thread():
        one = placed(variant, None)
    for rank, result in enumerate(runs[4]):
        assert_same(result["2d_" + variant], one, rank)


def test_fsdp_x_tp_as_torchtitan_lays_it_out_adds_no_difference(runs):
    for rank, result in enumerate(runs[4]):
        assert result["fsdp_tp"]["differed"] == [], (rank, result["fsdp_tp"])
    assert result["fsdp_tp"]["kinds"]["up.weight"] == "_StridedShard"  # the layout the test is about


@pytest.mark.parametrize("variant", RESUMED)
def test_state_files_cross_between_one_process_and_shards(runs, variant):
    """The project's state file: one process's (after step 1) resumed under FSDP2 at 2 and 4 ranks; the file
    those ranks write after the last step (rank 0, from every rank's pieces) resumed in one process: both as
    the uninterrupted run, bit for bit, state included."""
    one = single(variant)
    dtype, backend, kw = VARIANTS[variant]
    for world in (2, 4):
        for rank, result in enumerate(runs[world]):
            assert_same(result["file_" + variant], one, (world, rank), first=2)
        model = Tiny(dtype)
        opt = normuon.NorMuonAdamW(model, backend=backend, threads=1, **kw)
        opt.import_state(os.path.join(runs["out"], f"file-{variant}-w{world}.safetensors"))
        assert [g["step"] for g in opt.param_groups] == one["steps"]
        for name, p in model.named_parameters():
            assert torch.equal(p, one["params"][-1][name]), (world, name)
        state = opt.state_dict()["state"]
        assert set(state) == set(one["state"])
        for k, s in one["state"].items():
            assert state[k].keys() == s.keys() and all(torch.equal(state[k][key], v) for key, v in s.items()), (world, k)


@pytest.mark.parametrize("variant", DDP)
def test_ddp_over_plain_tensors_takes_the_same_path_bit_for_bit(runs, variant):
    one = single(variant)
    state = one["state"]
    for world in (2, 4):
        for rank, result in enumerate(runs[world]):
            got = result["ddp_" + variant]
            assert got["comm"]["bytes_sent"] > 0 or rank != 0  # rank 0 owns a matrix or two: it sends
            assert_same(got, one, (world, rank))
            assert set(got["state"]) == set(state)
            for k, s in state.items():  # one process's state dict, on every rank
                assert all(torch.equal(got["state"][k][key], v) for key, v in s.items()), (world, rank, k)


def test_what_is_not_served_is_refused_by_name(runs):
    for result in runs[2]:
        assert "plain tensor beside DTensor parameters" in result["mixed"]
        assert "the ranks of the mesh disagree on the parameters" in result["disagree"]
    assert "8 parameters here, 7 on rank 1" in runs[2][0]["disagree"]
    assert "7 parameters here, 8 on rank 0" in runs[2][1]["disagree"]


def test_bf16_masters_in_a_state_dict_before_any_step_are_the_models_values(runs):
    for result in runs[2]:
        assert all(result["masters"].values()) and len(result["masters"]) == 8, result["masters"]


def test_a_gradient_on_one_rank_only_is_refused_everywhere(runs):
    for result in runs[2]:
        assert "the ranks disagree on which parameters have a gradient" in result["grad_pattern"]
        assert result["unchanged"]


def test_a_nan_on_one_rank_gets_one_processs_verdict_everywhere(runs):
    for result in runs[2]:
        assert "step 1: gradient of 'down.weight' holds nan at element 54 (nothing was changed" in result["nan_error"]
        assert result["nan_skip_step"] == "step 1: gradient of 'down.weight' holds nan at element 54; step skipped"
        assert result["nan_unchanged"]


def test_the_bytes_each_step_moves_are_counted(runs):
    # Per step: one small all_reduce (the verdict; a second one only to name a NaN/Inf) and two all_to_alls
    # (the matrices' rows in and out).
    for world in (2, 4):
        for result in runs[world]:
            comm = result["fast_fp32"]["comm"]
            assert comm["collectives"] == 3 and comm["bytes_sent"] > 0 and comm["bytes_received"] > 0, comm
            assert result["fast_fp32"]["total"]["steps"] == STEPS
    one = train("fast_fp32", shard=False)
    assert one["comm"] is None and one["total"] is None


def test_fsdp1_flat_parameters_are_refused_by_name():
    flat = nn.Parameter(torch.zeros(40))
    flat._fsdp_flattened = True  # what FSDP1 (FullyShardedDataParallel) marks its flat parameters with
    with pytest.raises(ValueError, match="'_fsdp_wrapped_module._flat_param' is a flattened parameter of FSDP1"):
        normuon.NorMuonAdamW([("_fsdp_wrapped_module._flat_param", flat)])


@pytest.mark.parametrize("variant", RESUMED)
def test_one_processs_state_dict_loads_into_sharded_parameters(runs, variant):
    one = single(variant)
    for rank, result in enumerate(runs[2]):
        assert_same(result["whole_" + variant], one, rank, first=2)


@pytest.mark.parametrize("variant", RESUMED)
@pytest.mark.parametrize("world", [4, 1])
def test_a_checkpoint_saved_at_two_ranks_resumes_at_four_and_one_bit_for_bit(runs, world, variant):
    # torch.distributed.checkpoint: get_/set_optimizer_state_dict, dcp.save at world size 2 after step 1,
    # dcp.load at 4 and 1 (resharded), then steps 2.. as the uninterrupted single process.
    one = single(variant)
    for rank, result in enumerate(runs[world]):
        assert_same(result["resumed_" + variant], one, (world, rank), first=2)
