"""Mixture-of-experts banks [E, m, n] (transformers 5.x, torchtitan) stepped by NorMuon where they lie: each expert
is a matrix of its own, bit for bit what the same matrix gets as a 2-D parameter; state dicts hold the bank's shape;
state files name the experts and refuse a file that held the bank whole (AdamW)."""
import io
import warnings

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")

import normuon  # noqa: E402
from conftest import emulated_cuda_backend, require_native  # noqa: E402

SHAPES = {  # a layer of a MoE model as transformers 5.x names it, banks of 4 experts
    "model.layers.0.self_attn.q_proj.weight": (8, 8),
    "model.layers.0.mlp.experts.gate_up_proj": (4, 12, 8),
    "model.layers.0.mlp.experts.down_proj": (4, 8, 6),
    "model.layers.0.mlp.experts.gate_up_proj_bias": (4, 12),
    "model.layers.1.mlp.experts.gate_up_proj": (3, 12, 8),  # same expert shape, another bank: one bucket
    "model.layers.0.input_layernorm.weight": (8,),
}
BANKS = [n for n, s in SHAPES.items() if len(s) == 3]


def banked(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dtype)) for n, s in SHAPES.items()}


def split(params):
    """The same values with every bank as separate 2-D parameters, named as the layout names its experts."""
    out = {}
    for n, p in params.items():
        if n in BANKS:
            out.update({f"{n}[{k}]": torch.nn.Parameter(p.detach()[k].clone()) for k in range(p.shape[0])})
        else:
            out[n] = torch.nn.Parameter(p.detach().clone())
    return out


def give_grads(banks, experts, step, skip=()):
    g = torch.Generator().manual_seed(100 + step)
    for n, p in banks.items():
        grad = None if n in skip else torch.randn(p.shape, generator=g).to(p.dtype)
        p.grad = grad
        if n in BANKS:
            for k in range(p.shape[0]):
                experts[f"{n}[{k}]"].grad = None if grad is None else grad[k].clone()
        else:
            experts[n].grad = None if grad is None else grad.clone()


def assert_same(banks, experts, opt_b, opt_e):
    for n, p in banks.items():
        if n in BANKS:
            for k in range(p.shape[0]):
                mine, theirs = p.detach()[k], experts[f"{n}[{k}]"].detach()
                assert torch.equal(mine, theirs), f"{n}[{k}]"
                for key, v in opt_b.state[p].items():
                    assert torch.equal(v[k], opt_e.state[experts[f"{n}[{k}]"]][key]), f"{n}[{k}] {key}"
        else:
            assert torch.equal(p.detach(), experts[n].detach()), n


def path_kwargs(path):
    """The optimizer's keywords for one of the three paths: the fast CPU backend, the reference, the CUDA
    engine on the emulator."""
    require_native()
    if path == "cuda-emulated":
        return dict(_device_backend=emulated_cuda_backend())
    return dict(backend="reference") if path == "reference" else dict(threads=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", ["fast", "reference", "cuda-emulated"])
def test_a_bank_steps_as_its_experts_bit_for_bit(path, dtype):
    kw = path_kwargs(path)
    banks = banked(dtype)
    experts = split(banks)
    opt_b = normuon.NorMuonAdamW(list(banks.items()), **kw)
    opt_e = normuon.NorMuonAdamW(list(experts.items()), **kw)
    rows = {r["name"]: r for r in opt_b.routing_table()}
    assert all(rows[n]["role"] == "experts" and rows[n]["algorithm"] == "normuon" for n in BANKS)
    assert rows["model.layers.0.mlp.experts.gate_up_proj_bias"]["role"] == "bias"  # biases [E, f]: AdamW
    assert rows["model.layers.0.mlp.experts.gate_up_proj_bias"]["algorithm"] == "adamw"
    for step in range(4):
        give_grads(banks, experts, step, skip=BANKS[2:] if step == 1 else ())  # a bank without a gradient
        opt_b.step()
        opt_e.step()
        assert_same(banks, experts, opt_b, opt_e)
    state = opt_b.state[banks[BANKS[0]]]
    assert tuple(state["momentum_buffer"].shape) == (4, 12, 8)
    assert tuple(state["moment2_buffer"].shape) == (4, 12)
    assert opt_b.engine.layout.entries[1].name == f"{BANKS[0]}[0]"  # the layout holds the experts


def test_state_dict_holds_banks_and_resumes_bit_for_bit(native):
    banks = banked(torch.bfloat16)
    opt = normuon.NorMuonAdamW(list(banks.items()), threads=2)
    for step in range(2):
        give_grads(banks, split(banks), step)
        opt.step()
    saved = opt.state_dict()
    bank = saved["state"][1]
    assert {k: tuple(v.shape) for k, v in bank.items()} == {
        "momentum_buffer": (4, 12, 8), "moment2_buffer": (4, 12), "master_param": (4, 12, 8), "step": ()}
    assert int(bank["step"]) == 2
    again = {n: torch.nn.Parameter(p.detach().clone()) for n, p in banks.items()}
    resumed = normuon.NorMuonAdamW(list(again.items()), threads=2)
    resumed.load_state_dict(saved)
    for step in range(2, 4):
        give_grads(banks, split(banks), step)
        give_grads(again, split(again), step)
        opt.step()
        resumed.step()
    for n in SHAPES:
        assert torch.equal(banks[n].detach(), again[n].detach()), n
    wrong = dict(saved, state=dict(saved["state"]))
    wrong["state"][1] = dict(bank, moment2_buffer=torch.zeros(4 * 12))
    with pytest.raises(ValueError, match=r"moment2_buffer' of parameter 'model\.layers\.0\.mlp\.experts\.gate_up_proj' "
                                         r"has shape \(48,\), expected \(4, 12\)"):
        resumed.load_state_dict(wrong)


def test_state_files_name_the_experts_and_refuse_a_bank_saved_whole(native, tmp_path):
    banks = banked(torch.float32)
    opt = normuon.NorMuonAdamW(list(banks.items()), threads=2)
    give_grads(banks, split(banks), 0)
    opt.step()
    opt.export_state(tmp_path / "banks.nmst")
    again = {n: torch.nn.Parameter(torch.zeros_like(p)) for n, p in banks.items()}
    resumed = normuon.NorMuonAdamW(list(again.items()), threads=2)
    resumed.import_state(tmp_path / "banks.nmst")
    for n in SHAPES:
        assert torch.equal(banks[n].detach(), again[n].detach()), n
    give_grads(banks, split(banks), 1)
    give_grads(again, split(again), 1)
    opt.step()
    resumed.step()
    assert all(torch.equal(banks[n].detach(), again[n].detach()) for n in SHAPES)
    # A file from before banks were NorMuon's: each bank held whole, on AdamW, and the [E, f] expert biases, 2-D,
    # on NorMuon (as earlier versions routed them).
    then = {"*experts.*bias*": "normuon", "*experts.*": "adamw"}
    old = normuon.NorMuonAdamW(list(banked(torch.float32).items()), threads=2, overrides=then)
    old.export_state(tmp_path / "old.nmst")
    before = {n: p.detach().clone() for n, p in again.items()}
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' is an expert bank .* "
                                         r"saved whole.*'\*experts\.\*bias\*': 'normuon', '\*experts\.\*': 'adamw'"):
        resumed.import_state(tmp_path / "old.nmst")
    assert all(torch.equal(before[n], again[n].detach()) for n in SHAPES)  # nothing changed
    # What the message says to do loads it.
    as_then = normuon.NorMuonAdamW(list(again.items()), threads=2, overrides=then)
    as_then.import_state(tmp_path / "old.nmst")
    saved = dict(old_named(old))
    assert all(torch.equal(again[n].detach(), saved[n]) for n in SHAPES)


def old_named(opt):
    return [(n, p.detach()) for g in opt.param_groups for n, p in zip(g["param_names"], g["params"])]


def test_a_bank_reshaped_afterwards_is_refused(backend):
    """A bank whose tensor changed shape after the optimizer was built is refused by name on both backends (the
    reference compared the new shape with itself)."""
    w = torch.nn.Parameter(torch.randn(2, 6, 4))
    opt = normuon.NorMuonAdamW([("moe.experts.w", w)], backend=backend, threads=1)
    w.data = torch.randn(3, 6, 4)
    w.grad = torch.randn(3, 6, 4)
    with pytest.raises(RuntimeError, match=r"moe\.experts\.w.*3, 6, 4"):
        opt.step()


def test_routing_shows_banks_as_their_experts(native):
    opt = normuon.NorMuonAdamW(list(banked(torch.float32).items()), threads=1)
    text = io.StringIO()
    opt.print_routing(file=text)
    line = next(x for x in text.getvalue().splitlines() if "experts.down_proj" in x)
    assert "4 × 8x6" in line and "rule: expert bank (name)" in line, line
    assert opt.manifest_csv().count("model.layers.0.mlp.experts.down_proj[") == 4


def test_a_bank_by_role_and_banks_refused_elsewhere(native):
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(2, 4, 4, generator=g))
    opt = normuon.NorMuonAdamW([("moe.w_in", w)], roles={"moe.*": "experts"}, threads=1)
    assert opt.routing_table()[0]["algorithm"] == "normuon"
    with pytest.raises(ValueError, match=r"'moe\.w_in' is an expert bank without experts"):
        normuon.NorMuonAdamW([("moe.w_in", torch.zeros(0, 4, 4))], roles={"moe.w_in": "experts"})
    bias3 = torch.nn.Parameter(torch.randn(2, 1, 4, generator=g))  # a bias of any rank is a bias
    opt = normuon.NorMuonAdamW([("moe.experts.w_bias", bias3), ("moe.experts.w", w)], threads=1)
    assert [(r["role"], r["algorithm"], r["why"]) for r in opt.routing_table()] == [
        ("bias", "adamw", "rule: bias"), ("experts", "normuon", "rule: expert bank (name)")]
    with pytest.raises(ValueError, match=r"'moe\.w_in' is an expert bank without experts"):
        normuon.NorMuonAdamW([("moe.w_in", torch.zeros(0, 4, 4))], roles={"moe.w_in": "experts"})
    empty = normuon.NorMuonAdamW([("moe.w_in", torch.zeros(0, 4, 4))], roles={"moe.w_in": "experts"},
                                 overrides={"moe.w_in": "adamw"})  # whole, on AdamW: nothing to refuse
    assert empty.routing_table()[0]["algorithm"] == "adamw"
    four = torch.nn.Parameter(torch.randn(2, 2, 4, 4, generator=g))
    with pytest.warns(UserWarning, match=r"'moe\.experts\.w' \(3 or more dimensions\) went to AdamW"):
        opt = normuon.NorMuonAdamW([("moe.experts.w", four)], threads=1)  # only [E, m, n] is a bank
    assert opt.routing_table()[0]["algorithm"] == "adamw"


SPLIT = {  # fused projections: the gate's rows, then the up's
    "moe.experts.gate_up_proj": (3, 32, 16),  # blocks 16x16: statistics per row
    "moe.experts.wide_gate_up": (2, 32, 64),  # blocks 16x64: statistics per column (longer_dim)
    "mlp.gate_up.weight": (32, 16),           # a 2-D fused weight
}


def halves(params):
    """Each split tensor's blocks of rows as 2-D parameters of their own."""
    out = {}
    for n, p in params.items():
        blocks = [p.detach()] if p.dim() == 2 else list(p.detach())
        for k, b in enumerate(blocks):
            for j, half in enumerate(b.chunk(2)):
                out[f"{n}[{k}].part{j}"] = torch.nn.Parameter(half.clone())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", ["fast", "reference", "cuda-emulated"])
def test_split_rows_steps_each_block_as_a_matrix_of_its_own(path, dtype):
    kw = path_kwargs(path)
    g = torch.Generator().manual_seed(3)
    fused = {n: torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for n, s in SPLIT.items()}
    split = halves(fused)
    roles = {n: "matrix" for n in split}
    kw["reduce_axis"] = "longer_dim"  # statistics along each block's longer side: rows, or columns
    opt = normuon.NorMuonAdamW(list(fused.items()), split_rows={"*gate_up*": 2}, **kw)
    ref = normuon.NorMuonAdamW(list(split.items()), roles=roles, **kw)
    rows = {r["name"]: r for r in opt.routing_table()}
    assert rows["mlp.gate_up.weight"]["why"] == "rule: 2-D matrix (split into 2 blocks of rows)"
    assert opt.engine.layout.entries[1].name == "moe.experts.gate_up_proj[0].part1"
    for step in range(3):
        for n, p in fused.items():
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
            for k, b in enumerate([p.grad] if p.dim() == 2 else list(p.grad)):
                for j, half in enumerate(b.chunk(2)):
                    split[f"{n}[{k}].part{j}"].grad = half.clone()
        opt.step()
        ref.step()
        assert halves(fused).keys() == split.keys()
        for name, t in halves(fused).items():
            assert torch.equal(t.detach(), split[name].detach()), name
    state = {n: opt.state[p] for n, p in fused.items()}
    assert tuple(state["moe.experts.gate_up_proj"]["momentum_buffer"].shape) == (3, 32, 16)
    assert tuple(state["moe.experts.gate_up_proj"]["moment2_buffer"].shape) == (3, 32)     # per row: the blocks' rows
    assert tuple(state["moe.experts.wide_gate_up"]["moment2_buffer"].shape) == (2, 2, 64)  # per column: per block
    assert tuple(state["mlp.gate_up.weight"]["moment2_buffer"].shape) == (32,)
    upper = split["moe.experts.wide_gate_up[1].part1"]
    assert torch.equal(state["moe.experts.wide_gate_up"]["moment2_buffer"][1, 1], ref.state[upper]["moment2_buffer"])


def test_split_rows_refusals(native):
    w = torch.nn.Parameter(torch.randn(6, 8))
    with pytest.raises(ValueError, match=r"split_rows: parameter 'w' has 6 rows, not a multiple of 4"):
        normuon.NorMuonAdamW([("w", w)], split_rows={"w": 4})
    with pytest.raises(ValueError, match=r"cannot be split into 2 blocks of rows: the layout pads"):
        normuon.NorMuonAdamW([("w", w)], split_rows={"w": 2})  # blocks of 3x8: not whole lines of 16 floats
    with pytest.raises(ValueError, match=r"split_rows: parameter 'norm\.weight' \[8\] is not a matrix"):
        normuon.NorMuonAdamW([("w", w), ("norm.weight", torch.nn.Parameter(torch.ones(8)))],
                             split_rows={"norm.weight": 2})
    with pytest.raises(ValueError, match=r"split_rows pattern '\*up\*' matches no parameter"):
        normuon.NorMuonAdamW([("w", w)], split_rows={"*up*": 2})
    with pytest.raises(ValueError, match=r"split_rows names unknown parameter\(s\): v"):
        normuon.NorMuonAdamW([("w", w)], split_rows={"v": 2})
    with pytest.raises(ValueError, match=r"is not a number of blocks"):
        normuon.NorMuonAdamW([("w", w)], split_rows={"w": 1.5})


def test_split_rows_in_state_files_and_added_groups(native, tmp_path):
    g = torch.Generator().manual_seed(5)
    w = torch.nn.Parameter(torch.randn(32, 16, generator=g))
    whole = normuon.NorMuonAdamW([("a.gate_up.weight", w)], threads=1)
    whole.export_state(tmp_path / "whole.nmst")
    split = normuon.NorMuonAdamW([("a.gate_up.weight", w)], threads=1, split_rows={"*gate_up*": 2})
    with pytest.raises(ValueError, match=r"'a\.gate_up\.weight' is stepped as 2 blocks of rows here \(split_rows=\), "
                                         r"but the file has it whole"):
        split.import_state(tmp_path / "whole.nmst")
    split.export_state(tmp_path / "split.nmst")
    split.import_state(tmp_path / "split.nmst")
    # A group added later follows the constructor's split_rows patterns.
    b = torch.nn.Parameter(torch.randn(64, 16, generator=g))
    split.add_param_group({"params": [("b.gate_up.weight", b)]})
    assert [e.name for e in split.engine.layout.entries] == [
        "a.gate_up.weight.part0", "a.gate_up.weight.part1", "b.gate_up.weight.part0", "b.gate_up.weight.part1"]


def test_a_bank_in_a_bare_container_is_told_by_its_name():
    """torch.nn's containers (a bare nn.Module, a ModuleDict) say nothing of the parameters they hold: a bank held
    by one named experts is a bank by its name (the container's class made it 'other', AdamW, before)."""
    require_native()
    model = torch.nn.Module()
    model.experts = torch.nn.Module()
    model.experts.w1 = torch.nn.Parameter(torch.randn(3, 8, 6))
    model.blocks = torch.nn.ModuleDict({"experts": torch.nn.Module()})
    model.blocks["experts"].w2 = torch.nn.Parameter(torch.randn(3, 6, 8))
    model.proj = torch.nn.Linear(6, 6)
    rows = {r["name"]: r for r in normuon.NorMuonAdamW(model, threads=1).routing_table()}
    for name in ("experts.w1", "blocks.experts.w2"):
        assert (rows[name]["role"], rows[name]["algorithm"]) == ("experts", "normuon"), rows[name]
    assert (rows["proj.weight"]["role"], rows["proj.bias"]["role"]) == ("matrix", "bias")
    # A 3-D tensor a container holds outside any experts module (Reformer's axial position embeddings, in a
    # ParameterList) goes to AdamW by the rule, told by the container, with no warning.
    model.pos = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(4, 1, 6))])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = {r["name"]: r for r in normuon.NorMuonAdamW(model, threads=1).routing_table()}
    assert rows["pos.0"]["algorithm"] == "adamw"
