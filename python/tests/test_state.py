"""state_dict / load_state_dict in torch's structure, the project's state files, resume equivalence and
clear errors for mismatched state."""
import copy
import io

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")

import normuon  # noqa: E402
from conftest import fill_grads, make_model, params_of  # noqa: E402


@pytest.fixture(params=["fast", "reference"])
def backend(request):
    from conftest import require_native

    require_native()
    return request.param


def build(backend, dtype=None, seed=0, **kw):
    model = make_model(seed=seed, dtype=dtype)
    return model, normuon.NorMuonAdamW(model.named_parameters(), backend=backend, weight_decay=0.1,
                                       adamw_weight_decay=0.05, **kw)


def train(model, opt, steps, first=1):
    names = [n for n, _ in model.named_parameters()]
    for step in range(first, first + steps):
        fill_grads(model, step, skip={names[step % len(names)]})
        opt.step()


def same(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


def test_state_dict_structure(backend):
    model, opt = build(backend)
    train(model, opt, 2)
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"}
    g0, g1 = sd["param_groups"]
    assert g0["name"] == "normuon" and g0["algorithm"] == "normuon" and g0["step"] == 2
    assert g1["name"] == "adamw" and g1["betas"] == (0.9, 0.95) and g1["eps"] == 1e-10
    assert g0["params"] == list(range(len(g0["param_names"])))
    assert g1["params"] == list(range(len(g0["param_names"]), len(g0["param_names"]) + len(g1["param_names"])))
    named = dict(model.named_parameters())
    for i, name in enumerate(g0["param_names"] + g1["param_names"]):
        s = sd["state"][i]
        p = named[name]
        if i < len(g0["param_names"]):
            assert set(s) == {"momentum_buffer", "moment2_buffer", "step"}
            assert s["momentum_buffer"].shape == p.shape and s["moment2_buffer"].shape == (p.shape[0],)
        else:
            assert set(s) == {"exp_avg", "exp_avg_sq", "step"} and s["exp_avg"].shape == p.shape
        assert all(t.dtype == torch.float32 for t in s.values())
        # The parameter's own count, as torch's AdamW keeps it: train() left one parameter out of each step.
        missed = name in {n for n, _ in list(model.named_parameters())[1:3]}
        assert s["step"].shape == () and float(s["step"]) == (1 if missed else 2)
    # Copies, not views: training on does not change a state dict taken before.
    m = sd["state"][0]["momentum_buffer"].clone()
    train(model, opt, 1, first=3)
    assert torch.equal(sd["state"][0]["momentum_buffer"], m)
    assert not torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], m)
    assert torch.equal(opt.state[model.blocks[0].attn.weight]["momentum_buffer"],
                       opt.state_dict()["state"][0]["momentum_buffer"])  # opt.state: live views


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_save_load_round_trip_mid_run_resumes_bit_for_bit(backend, dtype):
    """4 steps, torch.save of model and optimizer, a fresh model and optimizer loaded from them, 3 more steps:
    equal bit for bit to 7 uninterrupted steps (the bf16 run needs master_param to get there)."""
    model, opt = build(backend, dtype)
    train(model, opt, 4)
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, blob)
    train(model, opt, 3, first=5)

    blob.seek(0)
    saved = torch.load(blob)
    model2, opt2 = build(backend, dtype, seed=1)  # different initial values: everything must come from the file
    opt2.load_state_dict(saved["opt"])
    model2.load_state_dict(saved["model"])
    assert [g["step"] for g in opt2.param_groups] == [4, 4]
    train(model2, opt2, 3, first=5)
    assert same(params_of(model), params_of(model2))
    a, b = opt.state_dict(), opt2.state_dict()
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])


def test_load_state_dict_restores_hyper_parameters_and_scheduler_keys(backend):
    model, opt = build(backend)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, 1)
    sched.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["initial_lr"] == 0.02 and sd["param_groups"][0]["lr"] == 0.01
    model2, opt2 = build(backend)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 0.01 and opt2.param_groups[0]["initial_lr"] == 0.02
    assert opt2.param_groups[0]["params"][0] is model2.blocks[0].attn.weight


def test_load_state_dict_errors_change_nothing(backend):
    model, opt = build(backend)
    train(model, opt, 2)
    good = opt.state_dict()
    model2, opt2 = build(backend, seed=1)
    train(model2, opt2, 1)
    before = opt2.state_dict()

    def broken(edit):
        sd = copy.deepcopy(good)
        edit(sd)
        return sd

    cases = [
        (lambda sd: sd["state"][0].update(momentum_buffer=torch.zeros(3, 3)),
         r"state 'momentum_buffer' of parameter 'blocks.0.attn.weight' has shape \(3, 3\), expected \(96, 32\)"),
        (lambda sd: sd["state"][0].pop("moment2_buffer"),
         r"state of parameter 'blocks.0.attn.weight' \(normuon\) has keys \['momentum_buffer'\]"),
        # A parameter's own count may not run ahead of its group's, nor be a fraction.
        (lambda sd: sd["state"][len(good["param_groups"][0]["param_names"])].update(step=torch.tensor(3.0)),
         r"state of parameter 'wte.weight': step=3 is not an integer in \[0, its group's step 2\]"),
        (lambda sd: sd["state"][len(good["param_groups"][0]["param_names"])].update(step=1.5),
         r"state of parameter 'wte.weight': step=1.5 is not an integer"),
        (lambda sd: sd["param_groups"].pop(),
         r"the state dict has 1 param groups, this optimizer 2 \(normuon, adamw\)"),
        (lambda sd: sd["param_groups"][0]["param_names"].__setitem__(0, "renamed.weight"),
         r"parameter names differ \('renamed.weight' saved vs 'blocks.0.attn.weight' here\)"),
        (lambda sd: sd["param_groups"][1].update(lr=float("nan")), r"option 'adamw.lr': 'nan' is not a finite number"),
        (lambda sd: sd["param_groups"][0].update(reduce_axis="longer_dim"), r"reduce_axis is 'longer_dim' in the state"),
        (lambda sd: sd.pop("state"), "expected the keys 'state' and 'param_groups'"),  # (other keys: ignored, as torch)
    ]
    for edit, message in cases:
        with pytest.raises(ValueError, match=message):
            opt2.load_state_dict(broken(edit))
        after = opt2.state_dict()
        assert [g["step"] for g in opt2.param_groups] == [1, 1]
        assert all(torch.equal(before["state"][i][k], after["state"][i][k])
                   for i in before["state"] for k in before["state"][i])
    other = normuon.NorMuonAdamW(make_model(d=16).named_parameters(), backend=backend)
    with pytest.raises(ValueError, match="has shape"):
        other.load_state_dict(good)


def test_export_import_state_file_resumes_bit_for_bit(backend, tmp_path, native):
    model, opt = build(backend)
    train(model, opt, 3)
    path = tmp_path / "opt.safetensors"
    opt.export_state(path)
    header = normuon._C.read_state_header(str(path))
    assert header["backend"] == opt.backend and header["group_steps"] == [3, 3]
    assert header["group_names"] == ["normuon", "adamw"]
    assert header["options"].hyper("normuon")["weight_decay"] == 0.1
    train(model, opt, 2, first=4)

    model2, opt2 = build(backend, seed=5, nonfinite="skip_step")
    opt2.param_groups[0]["lr"] = 0.5  # the file's hyper-parameters win
    opt2.import_state(path)
    assert opt2.param_groups[0]["lr"] == 0.02 and [g["step"] for g in opt2.param_groups] == [3, 3]
    assert opt2.nonfinite == "skip_step"  # a policy of this run, not taken from the file
    train(model2, opt2, 2, first=4)
    assert same(params_of(model), params_of(model2))


def test_state_file_errors(backend, tmp_path, native):
    model, opt = build(backend)
    train(model, opt, 1)
    path = tmp_path / "opt.safetensors"
    opt.export_state(path)
    # A different model: the layout fingerprint differs, and the error says how.
    _, other = build(backend)
    other_model = make_model(d=16)
    other = normuon.NorMuonAdamW(other_model.named_parameters(), backend=backend)
    before = params_of(other_model)
    with pytest.raises(normuon.StateFileError, match="layout fingerprint mismatch.*shape mismatch"):
        other.import_state(path)
    assert same(before, params_of(other_model)) and other.param_groups[0]["step"] == 0
    assert issubclass(normuon.StateFileError, RuntimeError)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:200])
    with pytest.raises(normuon.StateFileError, match="truncated"):
        opt.import_state(truncated)
    with pytest.raises(normuon.StateFileError):
        opt.import_state(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("saved_prefix,loaded_prefix", [("module.", ""), ("", "module."), ("_orig_mod.", "module.")])
def test_state_dicts_and_files_cross_wrapper_prefixes(tmp_path, saved_prefix, loaded_prefix, native):
    # A checkpoint saved under DDP (module.) or torch.compile (_orig_mod.) refused to load without the
    # prefix, and back: the names differed. Both forms now load and resume bit for bit.
    def build(prefix, seed):
        model = make_model(seed=seed)
        return model, normuon.NorMuonAdamW([(prefix + n, p) for n, p in model.named_parameters()], threads=1)

    model, opt = build(saved_prefix, 0)
    for step in (1, 2):
        fill_grads(model, step)
        opt.step()
    sd = opt.state_dict()
    opt.export_state(tmp_path / "state.safetensors")
    for how in ("state_dict", "file"):
        other, other_opt = build(loaded_prefix, 5)
        if how == "state_dict":
            other.load_state_dict(model.state_dict())
            other_opt.load_state_dict(sd)
        else:
            other_opt.import_state(tmp_path / "state.safetensors")
        assert [g["step"] for g in other_opt.param_groups] == [2, 2]
        for m, o in ((other, other_opt),):
            fill_grads(m, 3)
            o.step()
    fill_grads(model, 3)
    opt.step()
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(model.parameters(), other.parameters()))
    wrong = make_model()
    wrong_opt = normuon.NorMuonAdamW([("module.extra." + n, p) for n, p in wrong.named_parameters()])
    with pytest.raises(ValueError, match="parameter names differ"):
        wrong_opt.load_state_dict(sd)
    with pytest.raises(normuon.StateFileError, match="fingerprint"):
        wrong_opt.import_state(tmp_path / "state.safetensors")


def test_torch_state_dict_hooks_fire(native):
    opt = normuon.NorMuonAdamW(make_model())
    if not hasattr(opt, "register_state_dict_post_hook"):
        pytest.skip(f"torch {torch.__version__} has no optimizer state-dict hooks (torch >= 2.1)")
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("save-pre"))
    opt.register_state_dict_post_hook(lambda o, sd: dict(sd, extra=1) if calls.append("save-post") is None else sd)
    opt.register_load_state_dict_pre_hook(lambda o, sd: {k: v for k, v in sd.items() if k != "extra"})
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    sd = opt.state_dict()
    assert sd["extra"] == 1
    opt.load_state_dict(sd)  # the pre-hook takes "extra" out again, on a copy
    assert calls == ["save-pre", "save-post", "load-post"] and "extra" in sd


def edit_state_options(path, edit):
    """Rewrites the options inside a state file's header as a hostile writer would, re-signing the header
    (header_crc32 over the canonical JSON) so that the edit reaches the checks after it."""
    import json
    import struct
    import zlib

    raw = open(path, "rb").read()
    n, = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header["__metadata__"]
    options = json.loads(meta["options"])
    edit(options)
    meta["options"] = json.dumps(options)
    meta.pop("header_crc32")
    canonical = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    meta["header_crc32"] = "%08x" % zlib.crc32(canonical)
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    open(path, "wb").write(struct.pack("<Q", len(text)) + text + raw[8 + n:])


@pytest.mark.parametrize("field,value", [("ns_steps", 0), ("lr", -1.0), ("beta1", 5.0)])
def test_import_state_checks_the_files_values_before_changing_anything(tmp_path, field, value, native):
    # A file with ns_steps=0 (or a negative lr, or beta1=5) was imported in full (state, masters, the
    # model's parameters) before the error, or used as it was.
    model = make_model()
    opt = normuon.NorMuonAdamW(model)
    fill_grads(model, 1)
    opt.step()
    path = tmp_path / "s.safetensors"
    opt.export_state(path)

    def edit(options):
        group = next(g for g in options["groups"] if g["name"] == "normuon")
        group["hyper"][field] = value
    edit_state_options(path, edit)
    fill_grads(model, 2)
    opt.step()
    before = (params_of(model), opt.state_dict())
    with pytest.raises((ValueError, normuon.StateFileError), match=field):
        opt.import_state(path)
    after = (params_of(model), opt.state_dict())
    assert all(torch.equal(before[0][n], after[0][n]) for n in before[0])
    assert all(torch.equal(v, after[1]["state"][i][k]) for i, s in before[1]["state"].items() for k, v in s.items())
    assert before[1]["param_groups"] == after[1]["param_groups"]


def test_import_state_reads_the_file_once(tmp_path, monkeypatch, native):
    # The header (for wrapper prefixes) and the tensors came from two reads: a file replaced in between
    # could mix two versions. Now one read_state_file, and load_state_file from the same bytes.
    from normuon import optim as optim_module

    model = make_model()
    opt = normuon.NorMuonAdamW(model)
    fill_grads(model, 1)
    opt.step()
    opt.export_state(tmp_path / "s.safetensors")
    reads = []
    real = optim_module._C.read_state_file

    def counting(path):
        reads.append(path)
        return real(path)

    monkeypatch.setattr(optim_module._C, "read_state_file", counting)
    for name in ("read_state_header", "load_state"):
        monkeypatch.setattr(optim_module._C, name, lambda *a, **k: pytest.fail(f"a second read: {name}"))
    opt.import_state(tmp_path / "s.safetensors")
    assert reads == [str(tmp_path / "s.safetensors")]
