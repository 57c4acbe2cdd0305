"""Routing (spec section 2), overrides, param groups, the routing table and the backend selector."""
import io

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")

import normuon  # noqa: E402
from normuon import optim as optim_module  # noqa: E402
from conftest import make_model  # noqa: E402


def table(opt):
    return {r["name"]: r for r in opt.routing_table()}


def test_gpt_routing_table(native):
    model = make_model()
    opt = normuon.NorMuonAdamW(model.named_parameters())
    rows = table(opt)
    assert list(rows) == [n for n, _ in model.named_parameters()]  # manifest order = model order
    normuon_names = {n for n, r in rows.items() if r["algorithm"] == "normuon"}
    assert normuon_names == {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn", "proj", "mlp_fc", "mlp_proj")}
    assert rows["wte.weight"]["role"] == "embedding" and rows["wte.weight"]["algorithm"] == "adamw"
    assert rows["wpe.weight"]["role"] == "embedding" and rows["wpe.weight"]["algorithm"] == "adamw"
    assert rows["lm_head.weight"]["role"] == "head" and rows["lm_head.weight"]["algorithm"] == "adamw"
    assert rows["blocks.0.ln_1.weight"]["role"] == "norm"
    assert rows["blocks.0.attn.bias"]["role"] == "bias"
    assert rows["blocks.0.attn.weight"]["why"] == "rule: 2-D matrix"
    assert rows["blocks.0.attn.weight"]["group"] == "normuon" and rows["ln_f.bias"]["group"] == "adamw"
    assert [g["name"] for g in opt.param_groups] == ["normuon", "adamw"]
    assert opt.param_groups[0]["param_names"] == sorted(normuon_names, key=list(rows).index)
    text = opt.routing_text()
    assert "backend fast-cpu" in text and "blocks.1.mlp_proj.weight" in text
    # The C++ layout agrees with the Python routing, and the manifest carries no needless overrides.
    csv = opt.manifest_csv().splitlines()
    assert csv[0] == "name,shape,dtype,role,group,algorithm"
    assert "blocks.0.attn.weight,96x32,f32,matrix,,auto" in csv
    assert "wte.weight,64x32,f32,embedding,,auto" in csv


def test_print_routing(capsys, native):
    opt = normuon.NorMuonAdamW(make_model().named_parameters())
    opt.print_routing()
    out = capsys.readouterr().out
    assert out.startswith("NorMuonAdamW: 27 parameters, 24576 values on NorMuon, 5440 on AdamW")
    assert "lm_head.weight" in out and "rule: head" in out


def test_overrides_and_roles(native):
    model = make_model()
    opt = normuon.NorMuonAdamW(model.named_parameters(),
                               overrides={"blocks.0.proj.weight": "adamw", "lm_head.weight": "normuon"},
                               roles={"blocks.1.proj.weight": "embedding"})
    rows = table(opt)
    assert rows["blocks.0.proj.weight"]["algorithm"] == "adamw" and rows["blocks.0.proj.weight"]["why"] == "override"
    assert rows["lm_head.weight"]["algorithm"] == "normuon"
    assert rows["blocks.1.proj.weight"]["algorithm"] == "adamw"
    assert rows["blocks.1.proj.weight"]["why"] == "rule: embedding (roles=)"
    csv = opt.manifest_csv()
    assert "blocks.0.proj.weight,32x32,f32,matrix,,adamw" in csv
    assert "lm_head.weight,64x32,f32,head,,normuon" in csv


def test_non_matrix_forced_to_normuon_is_an_error():
    model = make_model()
    with pytest.raises(ValueError, match=r'"blocks.0.attn.bias" is routed to NorMuon but has shape \[96\]'):
        normuon.NorMuonAdamW(model.named_parameters(), overrides={"blocks.0.attn.bias": "normuon"})
    with pytest.raises(ValueError, match=r'"ln_f.weight" is routed to NorMuon .* needs a 2-D matrix'):
        normuon.NorMuonAdamW([{"params": [("ln_f.weight", model.ln_f.weight)], "algorithm": "normuon"}])
    with pytest.raises(ValueError, match="overrides name unknown parameter"):
        normuon.NorMuonAdamW(model.named_parameters(), overrides={"no.such.weight": "adamw"})
    with pytest.raises(ValueError, match="unknown algorithm 'muon'"):
        normuon.NorMuonAdamW(model.named_parameters(), overrides={"lm_head.weight": "muon"})


def test_param_groups(native):
    model = make_model()
    named = dict(model.named_parameters())
    blocks = [(n, p) for n, p in model.named_parameters() if n.startswith("blocks.")]
    rest = [(n, p) for n, p in model.named_parameters() if not n.startswith("blocks.")]
    opt = normuon.NorMuonAdamW([
        {"params": blocks, "name": "body", "lr": 0.01, "adamw_lr": 1e-3, "momentum": 0.9},
        {"params": [p for _, p in rest], "names": [n for n, _ in rest], "algorithm": "adamw", "name": "edges",
         "betas": (0.8, 0.99), "weight_decay": 0.1},
    ], weight_decay=0.05)
    groups = {g["name"]: g for g in opt.param_groups}
    assert list(groups) == ["body_normuon", "body_adamw", "edges"]
    assert groups["body_normuon"]["lr"] == 0.01 and groups["body_normuon"]["beta1"] == 0.9
    assert groups["body_normuon"]["weight_decay"] == 0.05  # constructor default
    assert groups["body_adamw"]["lr"] == 1e-3 and groups["body_adamw"]["betas"] == (0.9, 0.95)
    assert groups["edges"]["betas"] == (0.8, 0.99) and groups["edges"]["weight_decay"] == 0.1
    rows = table(opt)
    assert rows["wte.weight"]["group"] == "edges" and rows["wte.weight"]["why"] == "group 'edges'"
    assert rows["blocks.0.ln_1.weight"]["group"] == "body_adamw"
    assert all(r["algorithm"] == "normuon" for n, r in rows.items() if n.endswith("proj.weight"))
    assert sum(len(g["params"]) for g in opt.param_groups) == len(named)
    assert "blocks.0.attn.weight,96x32,f32,matrix,body_normuon,auto" in opt.manifest_csv()


def test_param_group_errors():
    model = make_model()
    with pytest.raises(ValueError, match="unknown key"):
        normuon.NorMuonAdamW([{"params": list(model.named_parameters()), "bettas": (0.9, 0.9)}])
    with pytest.raises(ValueError, match="a parameter group with duplicate parameters: 'b' is there twice"):
        normuon.NorMuonAdamW([("a", model.lm_head.weight), ("b", model.lm_head.weight)])
    with pytest.raises(ValueError, match="empty parameter list"):
        normuon.NorMuonAdamW([])
    with pytest.raises(TypeError, match="unexpected keyword"):
        normuon.NorMuonAdamW(model.named_parameters(), ns_stepz=3)
    with pytest.raises(ValueError, match=r"param_groups\[0\] \('normuon', normuon\): option 'normuon.lr': -1 is outside"):
        normuon.NorMuonAdamW(model.named_parameters(), lr=-1.0)
    with pytest.raises(ValueError, match=r"option 'normuon.reduce_axis': unknown value 'cols' \(choose rows \| longer_dim\)"):
        normuon.NorMuonAdamW(model.named_parameters(), reduce_axis="cols")


def test_betas_are_in_zero_to_one_open_as_torch_has_them(backend):
    # beta = 1 was accepted: AdamW's bias correction 1 - beta^t is then 0 and every AdamW value became NaN.
    model = make_model()
    with pytest.raises(ValueError, match=r"option 'adamw.beta2': 1 is outside \[0, 1\)"):
        normuon.NorMuonAdamW(model.named_parameters(), adamw_betas=(0.9, 1.0), backend=backend)
    with pytest.raises(ValueError, match=r"option 'normuon.beta1': 1 is outside \[0, 1\)"):
        normuon.NorMuonAdamW(model.named_parameters(), beta1=1, backend=backend)
    opt = normuon.NorMuonAdamW(model.named_parameters(), adamw_betas=(0.0, 0.999), backend=backend)
    opt.param_groups[1]["betas"] = (0.9, 1.0)  # a scheduler's value is checked at the step, before any change
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"option 'adamw.beta2': 1 is outside \[0, 1\)"):
        opt.step()
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())


def test_add_param_group_keeps_what_was_there_and_starts_the_new_group_fresh(backend):
    # It raised NotImplementedError. Now: the optimizer over the first parameters, then a group added (a
    # layer unfrozen), equals two optimizers, one continuing and one started when the group was added.
    from conftest import fill_grads

    model, twin = make_model(), make_model()
    blocks = [n for n, _ in model.named_parameters() if n.startswith("blocks.0.")]
    rest = [n for n, _ in model.named_parameters() if n not in blocks]

    def params(m, names):
        return [(n, p) for n, p in m.named_parameters() if n in names]

    opt = normuon.NorMuonAdamW(params(model, rest), backend=backend, weight_decay=0.1, adamw_weight_decay=0.05)
    first = normuon.NorMuonAdamW(params(twin, rest), backend=backend, weight_decay=0.1, adamw_weight_decay=0.05)
    for step in (1, 2):
        for m in (model, twin):
            fill_grads(m, step, skip=blocks)
        opt.step()
        first.step()
    opt.add_param_group({"params": params(model, blocks), "name": "late", "lr": 0.01, "adamw_lr": 1e-3})
    second = normuon.NorMuonAdamW([{"params": params(twin, blocks), "name": "late", "lr": 0.01, "adamw_lr": 1e-3}],
                                  backend=backend, weight_decay=0.1, adamw_weight_decay=0.05)  # the defaults
    assert [g["name"] for g in opt.param_groups] == ["normuon", "adamw", "late_normuon", "late_adamw"]
    assert [g["step"] for g in opt.param_groups] == [2, 2, 0, 0]
    assert table(opt)["wte.weight"]["why"] == "rule: embedding (name)"  # routing as it was
    for step in (3, 4):
        for m in (model, twin):
            fill_grads(m, step)
        opt.step()
        first.step()
        second.step()
    for (n, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a.detach(), b.detach()), n
    assert [g["step"] for g in opt.param_groups] == [4, 4, 2, 2]
    assert torch.equal(opt.state[model.wte.weight]["exp_avg"], first.state[twin.wte.weight]["exp_avg"])


def test_add_param_group_names_from_the_model_and_refuses_cleanly(native):
    model = make_model()
    head = model.lm_head.weight
    opt = normuon.NorMuonAdamW([(n, p) for n, p in model.named_parameters() if p is not head], model=model)
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group: 'wte.weight'"):
        opt.add_param_group({"params": [model.wte.weight]})
    with pytest.raises(ValueError, match="a dict with 'params'"):
        opt.add_param_group([head])
    assert len(opt.param_groups) == 2 and head not in opt.state
    opt.add_param_group({"params": [head]})  # named and routed by the model: the head goes to AdamW
    row = {r["name"]: r for r in opt.routing_table()}["lm_head.weight"]
    assert row["algorithm"] == "adamw" and row["group"] == "group2_adamw" and "vocabulary" in row["why"]


def test_backend_selector(monkeypatch, native):
    model = make_model()
    monkeypatch.delenv("NORMUON_BACKEND", raising=False)
    assert normuon.NorMuonAdamW(model.named_parameters()).backend == "fast-cpu"
    assert normuon.NorMuonAdamW(model.named_parameters(), backend="fast").backend == "fast-cpu"
    assert normuon.NorMuonAdamW(model.named_parameters(), backend="reference").backend == "reference-cpu"
    monkeypatch.setenv("NORMUON_BACKEND", "reference")
    assert normuon.NorMuonAdamW(model.named_parameters()).backend == "reference-cpu"
    assert normuon.NorMuonAdamW(model.named_parameters(), backend="fast").backend == "fast-cpu"  # argument wins
    monkeypatch.setenv("NORMUON_BACKEND", "fastest")
    with pytest.raises(ValueError, match="environment variable NORMUON_BACKEND: unknown backend 'fastest'"):
        normuon.NorMuonAdamW(model.named_parameters())
    with pytest.raises(ValueError, match="backend: unknown backend 'gpu'"):
        normuon.NorMuonAdamW(model.named_parameters(), backend="gpu")


def test_without_native_nothing_runs_and_every_backend_says_why(monkeypatch):
    """Without normuon._C every backend refuses with the import error, the reference too: the rules it
    steps by (the fields and their checks, the routing, the backend choice) are the core's."""
    from normuon import native
    monkeypatch.setattr(native, "_C", None)
    monkeypatch.setattr(native, "_C_IMPORT_ERROR", "ImportError: simulated")
    monkeypatch.delenv("NORMUON_BACKEND", raising=False)
    model = make_model()
    for choice in (None, "auto", "fast", "reference"):
        with pytest.raises(RuntimeError, match="NorMuonAdamW needs the native module normuon._C.*simulated"):
            normuon.NorMuonAdamW(model.named_parameters(), backend=choice)


def test_unnamed_matrices_warn(native):
    model = make_model()
    with pytest.warns(UserWarning, match="matrices without names"):
        opt = normuon.NorMuonAdamW(model.parameters())
    assert opt.routing_table()[0]["name"] == "param0" and opt.routing_table()[0]["algorithm"] == "normuon"


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "copy"])
def test_pickling_and_copying_raise_a_clear_type_error(how, backend):
    # They used to succeed and return an optimizer whose native buffers were lost or shared.
    import copy
    import pickle

    from normuon.megatron import MegatronAdamW

    do = {"pickle": pickle.dumps, "deepcopy": copy.deepcopy, "copy": copy.copy}[how]
    model = make_model()
    for opt in (normuon.NorMuonAdamW(model, backend=backend),
                MegatronAdamW([torch.zeros(3, requires_grad=True)], backend=backend)):
        with pytest.raises(TypeError, match="cannot be pickled or copied.*state_dict"):
            do(opt)
    with pytest.raises(TypeError, match="NorMuonAdamW cannot be pickled"):
        torch.save(normuon.NorMuonAdamW(model, backend=backend), io.BytesIO())


def test_a_name_that_is_not_utf8_gets_a_clear_error(native):
    # It reached pybind's "incompatible constructor arguments" for the C++ manifest.
    with pytest.raises(ValueError, match="is not valid UTF-8"):
        normuon.NorMuonAdamW([("w\udcff", torch.nn.Parameter(torch.zeros(4, 4)))])


def test_add_param_group_with_a_bad_value_changes_nothing(native):
    # The new group's values were checked after the groups and entries had been replaced: the optimizer
    # was left broken (its steps reset, state_dict failing).
    model = make_model()
    opt = normuon.NorMuonAdamW(model)
    from conftest import fill_grads
    fill_grads(model, 1)
    opt.step()
    before = opt.state_dict()
    with pytest.raises(ValueError, match="'group2_normuon.lr': -1 is outside"):
        opt.add_param_group({"params": [("extra.weight", torch.nn.Parameter(torch.zeros(8, 8)))], "lr": -1})
    assert len(opt.param_groups) == 2 and [g["step"] for g in opt.param_groups] == [1, 1]
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    fill_grads(model, 2)
    opt.step()
    # Keys that schedulers and users keep in the groups stay (and a new group may bring its own).
    opt.param_groups[0]["initial_lr"] = 0.02
    opt.add_param_group({"params": [("extra.weight", torch.nn.Parameter(torch.zeros(8, 8)))], "initial_lr": 0.1})
    assert opt.param_groups[0]["initial_lr"] == 0.02 and opt.param_groups[-1]["initial_lr"] == 0.1


def test_groups_given_as_generators_keep_every_parameter(native):
    """A group's "params" may be a generator (module.parameters(), as torch's optimizers take them): walked
    more than once while planning, it must be read once (it was used up: parameters lost without a word)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    with pytest.warns(UserWarning, match="without names"):
        opt = normuon.NorMuonAdamW([{"params": model[0].parameters()},
                                    {"params": list(model[1].parameters()), "lr": 0.01}], threads=1)
    assert sum(len(g["params"]) for g in opt.param_groups) == 4
    opt = normuon.NorMuonAdamW([{"params": model.parameters()}], model=model, threads=1)
    assert sum(len(g["params"]) for g in opt.param_groups) == 4
