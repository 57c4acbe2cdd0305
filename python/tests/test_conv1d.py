"""Matrices stored [in, out] (transformers' Conv1D: GPT-2's c_attn, c_fc, c_proj): NorMuon's statistics run per
output feature, the module's rows, and its shape factor comes from [out, in], so a Conv1D weight steps as its
nn.Linear twin (the transpose) does; transposed= says which, over the modules' word, and {"*": False} keeps the
stored rows."""
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")

import normuon  # noqa: E402
from conftest import emulated_cuda_backend, require_native  # noqa: E402

SHAPES = {"h.0.mlp.c_fc.weight": (16, 24), "h.0.mlp.c_proj.weight": (24, 16), "h.0.attn.c_proj.weight": (16, 16),
          "h.0.mlp.experts.gate_up_proj": (3, 16, 24)}  # a bank [E, in, out], as gpt-oss stores its experts


def path_kwargs(path):
    """The optimizer's keywords for the fast CPU backend, the reference or the CUDA engine on the emulator."""
    require_native()
    if path == "cuda-emulated":
        return dict(_device_backend=emulated_cuda_backend())
    return dict(backend="reference") if path == "reference" else dict(threads=2)


def pair(seed=0):
    """Conv1D-style weights [in, out] and their nn.Linear twins [out, in], holding the same values."""
    g = torch.Generator().manual_seed(seed)
    stored = {n: torch.nn.Parameter(torch.randn(s, generator=g) * 0.5) for n, s in SHAPES.items()}
    twins = {n: torch.nn.Parameter(p.detach().transpose(-2, -1).contiguous()) for n, p in stored.items()}
    return stored, twins


def give_grads(stored, twins, step):
    g = torch.Generator().manual_seed(100 + step)
    for n, p in stored.items():
        p.grad = torch.randn(p.shape, generator=g)
        twins[n].grad = p.grad.transpose(-2, -1).contiguous()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("axis", ["rows", "longer_dim"])
@pytest.mark.parametrize("path", ["fast", "reference", "cuda-emulated"])
def test_a_transposed_matrix_steps_as_its_linear_twin(path, axis, precision):
    kw = dict(path_kwargs(path), reduce_axis=axis, ns_precision=precision, weight_decay=0.1)
    stored, twins = pair()
    opt_s = normuon.NorMuonAdamW(list(stored.items()), transposed={"*": True}, **kw)
    opt_t = normuon.NorMuonAdamW(list(twins.items()), **kw)
    assert all(r["transposed"] for r in opt_s.routing_table())
    for step in range(3):
        give_grads(stored, twins, step)
        opt_s.step()
        opt_t.step()
    for n, p in stored.items():
        twin, mine, theirs = twins[n].detach(), opt_s.state[p], opt_t.state[twins[n]]
        square = p.shape[-2] == p.shape[-1]
        if square and precision == "bf16":
            # A square matrix iterates on its stored orientation (X Xt, not the twin's Xt X), which rounds apart
            # in bf16: close, not equal (the fp32 runs hold its statistics axis to the twin's).
            torch.testing.assert_close(p.detach().transpose(-2, -1), twin, rtol=0, atol=3e-3, msg=n)
            continue
        # Newton-Schulz iterates on the wide orientation, so on the fused backends a non-square matrix gets its
        # twin's bits on every backend (the whole-matrix norms add the stored rows' sums: a last bit could differ,
        # none does); a square matrix iterates on its stored orientation, in fp32 a few ulp apart.
        exact = not square
        torch.testing.assert_close(p.detach().transpose(-2, -1), twin, rtol=0 if exact else 1e-6,
                                   atol=0 if exact else 1e-7, msg=n)
        torch.testing.assert_close(mine["momentum_buffer"].transpose(-2, -1), theirs["momentum_buffer"], rtol=0, atol=0,
                                   msg=n)
        # one second moment per output feature: the twin's per row (or by the longer side), here per column
        torch.testing.assert_close(mine["moment2_buffer"], theirs["moment2_buffer"], rtol=0 if exact else 1e-5, atol=0,
                                   msg=n)


@pytest.mark.parametrize("path", ["fast", "reference"])
def test_stored_rows_stay_available_and_differ(path):
    """transposed={"*": False} (or no word) steps the stored matrix as it is: what earlier versions did, and not
    what the module's twin gets (the shape factor of c_fc's [24, 8] is sqrt(3), of its stored [8, 24] 1)."""
    stored, twins = pair()
    plain = {n: torch.nn.Parameter(p.detach().clone()) for n, p in stored.items()}
    opt_s = normuon.NorMuonAdamW(list(stored.items()), transposed={"h.*": False}, **path_kwargs(path))
    opt_p = normuon.NorMuonAdamW(list(plain.items()), **path_kwargs(path))
    opt_t = normuon.NorMuonAdamW(list(twins.items()), **path_kwargs(path))
    for step in range(2):
        give_grads(stored, twins, step)
        for n, p in plain.items():
            p.grad = stored[n].grad.clone()
        for opt in (opt_s, opt_p, opt_t):
            opt.step()
    for n, p in stored.items():
        assert torch.equal(p.detach(), plain[n].detach()), n
    fc = "h.0.mlp.c_fc.weight"
    assert (stored[fc].detach().t() - twins[fc].detach()).abs().max() > 1e-3
    assert not any(r["transposed"] for r in opt_s.routing_table())


def tiny_gpt2():
    transformers = pytest.importorskip("transformers", reason="transformers from PyPI (scripts/setup.sh)")
    config = transformers.GPT2Config(vocab_size=96, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def test_gpt2s_conv1d_weights_follow_their_module():
    require_native()
    model = tiny_gpt2()
    opt = normuon.NorMuonAdamW(model, threads=2)
    rows = {r["name"]: r for r in opt.routing_table()}
    conv = [n for n in rows if any(k in n for k in ("c_attn.weight", "c_fc.weight", "c_proj.weight"))]
    assert len(conv) == 8
    for n in conv:
        r = rows[n]
        assert r["algorithm"] == "normuon" and r["transposed"], r
        assert "stored [in, out]: Conv1D" in r["why"], r
        assert r["stats"] == "cols", r  # per output feature: the stored columns
    assert not rows["transformer.wte.weight"]["transposed"]  # (the head is tied to it)
    assert "stored [in, out]" in opt.routing_text()
    # The model's own gradients step, and a state dict resumes bit for bit.
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    opt.step()
    saved = opt.state_dict()
    assert [len(g.get("transposed", ())) for g in saved["param_groups"]] == [8, 0]  # NorMuon's group names them
    again = normuon.NorMuonAdamW(model, threads=2)
    again.load_state_dict(saved)
    for p in model.parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(v, again.state[p][k]), k

    # The stored rows by the knob; a state dict of one reading does not load into the other.
    stored_rows = normuon.NorMuonAdamW(model, threads=2, transposed={"*": False})
    assert all(not r["transposed"] and "Conv1D" not in r["why"] for r in stored_rows.routing_table())
    with pytest.raises(ValueError, match=r"holds 8 matrices stored \[in, out\] \(transposed\), this optimizer 0; "
                                         r"'transformer.h.0.attn.c_attn.weight', .* and 5 more differ.*the modules' "
                                         r"reading"):
        stored_rows.load_state_dict(saved)
    with pytest.raises(ValueError, match=r"holds no matrices stored \[in, out\] \(transposed\), this optimizer 8; .*"
                                         r"build the optimizer with transposed=\{'\*': False\} to load it"):
        normuon.NorMuonAdamW(model, threads=2).load_state_dict(stored_rows.state_dict())


def test_a_flattened_distributed_checkpoint_keeps_the_transposition():
    """torch.distributed.checkpoint's flattened optimizer state dict keeps only the live groups' keys: the groups
    hold their transposed matrices' names, so the reading survives it, both ways."""
    require_native()
    model = tiny_gpt2()
    dcp = pytest.importorskip("torch.distributed.checkpoint.state_dict", reason="this torch has no DCP state dicts")
    flat = dcp.StateDictOptions(flatten_optimizer_state_dict=True)
    get_optimizer_state_dict, set_optimizer_state_dict = dcp.get_optimizer_state_dict, dcp.set_optimizer_state_dict
    opt = normuon.NorMuonAdamW(model, threads=2)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    opt.step()
    saved = get_optimizer_state_dict(model, opt, options=flat)
    again = normuon.NorMuonAdamW(model, threads=2)
    set_optimizer_state_dict(model, again, saved, options=flat)
    for p in model.parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(v, again.state[p][k]), k
    with pytest.raises(ValueError, match="matrices stored"):
        set_optimizer_state_dict(model, normuon.NorMuonAdamW(model, threads=2, transposed={"*": False}), saved,
                                 options=flat)


def test_what_adamw_steps_is_never_transposed():
    """AdamW's state has no axis: a Conv1D weight routed to AdamW is not marked, and a state dict of the stored
    reading loads into the modules' reading for it."""
    require_native()
    model = tiny_gpt2()
    moved = {"*.c_fc.weight": "adamw"}
    opt = normuon.NorMuonAdamW(model, threads=2, overrides=moved)
    rows = {r["name"]: r for r in opt.routing_table()}
    assert rows["transformer.h.0.mlp.c_fc.weight"]["algorithm"] == "adamw"
    assert not rows["transformer.h.0.mlp.c_fc.weight"]["transposed"]
    assert rows["transformer.h.0.attn.c_attn.weight"]["transposed"]
    both = dict(overrides=moved, transposed={"*attn*": False, "*c_proj*": False})
    opt = normuon.NorMuonAdamW(model, threads=2, **both)
    assert not any(r["transposed"] for r in opt.routing_table())
    normuon.NorMuonAdamW(model, threads=2, **both).load_state_dict(opt.state_dict())


def test_a_modules_word_applies_only_where_it_can():
    """A module saying is_transposed over a 3-D tensor that is no expert bank (roles=, or not named experts)
    leaves it as it is, without an error; transposed= on it is refused."""
    require_native()

    class Ffn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.has_gate, self.is_transposed = True, True
            self.w_in = torch.nn.Parameter(torch.randn(4, 8, 12))

    model = torch.nn.Module()
    model.ffn = Ffn()
    model.proj = torch.nn.Linear(8, 8)
    with pytest.warns(UserWarning, match="went to AdamW by the rule"):
        opt = normuon.NorMuonAdamW(model, threads=1)
    assert not any(r["transposed"] for r in opt.routing_table())
    opt = normuon.NorMuonAdamW(model, threads=1, roles={"ffn.w_in": "other"})
    assert not any(r["transposed"] for r in opt.routing_table())
    with pytest.raises(ValueError, match=r"transposed: parameter 'ffn.w_in' \[4, 8, 12\] is not a matrix"):
        normuon.NorMuonAdamW(model, threads=1, roles={"ffn.w_in": "other"}, transposed={"ffn.w_in": True})
    with pytest.raises(ValueError, match="'transposed' is the optimizer's own group key"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(8, 8))], "transposed": ["x"]})


def test_state_files_carry_the_transposition(tmp_path):
    require_native()
    model = tiny_gpt2()
    opt = normuon.NorMuonAdamW(model, threads=2)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.export_state(tmp_path / "s.bin")
    assert ",yes" in opt.manifest_csv() and "transposed" in opt.manifest_csv().splitlines()[0]
    normuon.NorMuonAdamW(model, threads=2).import_state(tmp_path / "s.bin")
    stored_rows = normuon.NorMuonAdamW(model, threads=2, transposed={"*": False})
    with pytest.raises(Exception, match="layout fingerprint mismatch"):  # the statistics run along another axis
        stored_rows.import_state(tmp_path / "s.bin")
    # A file of earlier versions (every matrix by its stored rows) names the knob that loads it.
    stored_rows.export_state(tmp_path / "old.bin")
    with pytest.raises(ValueError, match=r"holds every matrix by its stored rows.*'transformer.h.0.attn.c_attn.weight'"
                                         r".*and 5 more.*transposed=\{'\*': False\} to load it"):
        normuon.NorMuonAdamW(model, threads=2).import_state(tmp_path / "old.bin")


def test_add_param_group_keeps_and_finds_the_transposition():
    require_native()
    model = tiny_gpt2()
    head = [p for n, p in model.named_parameters() if n.startswith("transformer.h.1.")]
    first = [(n, p) for n, p in model.named_parameters() if not n.startswith("transformer.h.1.")]
    opt = normuon.NorMuonAdamW(first, model=model, threads=2)
    opt.add_param_group({"params": head})
    rows = {r["name"]: r for r in opt.routing_table()}
    assert rows["transformer.h.0.mlp.c_fc.weight"]["transposed"]
    assert rows["transformer.h.1.mlp.c_fc.weight"]["transposed"]


def test_refusals():
    require_native()
    w = torch.nn.Parameter(torch.randn(8, 24))
    b = torch.nn.Parameter(torch.randn(24))
    params = [("c_fc.weight", w), ("c_fc.bias", b)]
    with pytest.raises(ValueError, match=r"transposed: parameter 'c_fc.bias' \[24\] is not a matrix"):
        normuon.NorMuonAdamW(params, transposed={"c_fc.bias": True})
    with pytest.raises(ValueError, match="transposed pattern 'nothing.*' matches no parameter"):
        normuon.NorMuonAdamW(params, transposed={"nothing.*": True})
    with pytest.raises(ValueError, match="transposed names unknown parameter"):
        normuon.NorMuonAdamW(params, transposed={"c_attn.weight": True})
    with pytest.raises(ValueError, match="is not True or False"):
        normuon.NorMuonAdamW(params, transposed={"c_fc.weight": "yes"})
    with pytest.raises(ValueError, match=r"split_rows: parameter 'c_fc.weight' is stored \[in, out\].*its outputs are "
                                         r"its columns"):
        normuon.NorMuonAdamW(params, transposed={"c_fc.weight": True}, split_rows={"c_fc.weight": 2})
    opt = normuon.NorMuonAdamW(params, transposed={"c_fc.weight": True, "c_fc.bias": False})
    assert [r["transposed"] for r in opt.routing_table()] == [True, False]


def test_gpt_oss_expert_banks_follow_their_module():
    """gpt-oss stores its experts [E, in, out] and says so (is_transposed): each expert steps as [out, in]."""
    require_native()
    transformers = pytest.importorskip("transformers", reason="transformers from PyPI (scripts/setup.sh)")
    config = transformers.GptOssConfig(vocab_size=96, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=4,
                                       num_experts_per_tok=2, layer_types=["full_attention"])
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    opt = normuon.NorMuonAdamW(model, threads=2)
    rows = {r["name"]: r for r in opt.routing_table()}
    for n in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
        assert rows[n]["role"] == "experts" and rows[n]["transposed"], rows[n]
        assert "GptOssExperts 'model.layers.0.mlp.experts' is_transposed" in rows[n]["why"], rows[n]
    assert not rows["model.layers.0.mlp.experts.gate_up_proj_bias"]["transposed"]
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    opt.step()
    bank = dict(model.named_parameters())["model.layers.0.mlp.experts.down_proj"]  # [4, 24, 16]: per column
    assert opt.state[bank]["moment2_buffer"].shape == (4, 16)


def test_a_conv1d_wrapped_by_fully_shard_is_still_one():
    """fully_shard swaps a module's class for a subclass (FSDPConv1D): the base class still tells."""
    require_native()
    model = tiny_gpt2()
    block = model.transformer.h[0].mlp.c_fc
    block.__class__ = type("FSDPConv1D", (type(block),), {})
    rows = {r["name"]: r for r in normuon.NorMuonAdamW(model, threads=1).routing_table()}
    assert rows["transformer.h.0.mlp.c_fc.weight"]["transposed"]
    assert "Conv1D 'transformer.h.0.mlp.c_fc'" in rows["transformer.h.0.mlp.c_fc.weight"]["why"]
