"""Routing that cannot silently go wrong (issue: common models were misrouted by name): a model routed by its
modules, explicit normuon_params / adamw_params, name rules that strip wrapper prefixes and know the common
names, and the warnings when names are all there is."""
import io
import warnings

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")
from torch import nn  # noqa: E402

import normuon  # noqa: E402
from normuon.routing import infer_role, strip_wrappers  # noqa: E402


def table(opt):
    return {r["name"]: r for r in opt.routing_table()}


def adamw_names(opt):
    return {r["name"] for r in opt.routing_table() if r["algorithm"] == "adamw"}


class MinGPT(nn.Module):
    """minGPT's names: tok_emb, a 2-D pos_emb Parameter, blocks, ln_f, head; optionally tied."""

    def __init__(self, vocab=50, d=16, ctx=8, tied=False):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Parameter(torch.zeros(ctx, d))
        self.blocks = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok_emb.weight


class Unrevealing(nn.Module):
    """Names that say nothing: an embedding called 'table' and a head called 'out'."""

    def __init__(self, vocab=50, d=16):
        super().__init__()
        self.table = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab)


class Wrapper(nn.Module):  # what DDP and torch.compile add: one more level named module / _orig_mod
    def __init__(self, inner, name="module"):
        super().__init__()
        self.add_module(name, inner)


@pytest.mark.parametrize("name,shape,role", [
    ("tok_emb.weight", (50, 16), "embedding"),
    ("pos_emb", (8, 16), "embedding"),
    ("token_emb.weight", (50, 16), "embedding"),
    ("emb.weight", (50, 16), "embedding"),
    ("shared.weight", (50, 16), "embedding"),                       # T5
    ("model.embed_tokens.weight", (50, 16), "embedding"),           # Llama (HF)
    ("module.head.weight", (50, 16), "head"),                       # DDP
    ("_orig_mod.output.weight", (50, 16), "head"),                  # torch.compile, Llama (Meta)
    ("model.classifier.weight", (10, 16), "head"),
    ("module._orig_mod.lm_head.weight", (50, 16), "head"),
    ("cls.predictions.decoder.weight", (50, 16), "head"),           # BERT
    ("module.score.weight", (2, 16), "head"),                       # HF sequence classification
    ("bert.encoder.layer.0.output.dense.weight", (16, 64), "matrix"),  # an 'output' inside a block
    ("cls.predictions.transform.dense.weight", (16, 16), "matrix"),
    ("model.layers.0.mlp.shared_experts.up_proj.weight", (64, 16), "matrix"),
    ("module.blocks.0.ln_1.weight", (16,), "norm"),
    ("module.blocks.0.attn.bias", (48,), "bias"),
])
def test_name_rules_strip_wrappers_and_know_common_names(name, shape, role):
    # Before, tok_emb / pos_emb / token_emb / emb / shared went to NorMuon, and so did head, output and
    # classifier once a wrapper prefix came before them.
    assert infer_role(name, shape) == role


def test_strip_wrappers():
    assert strip_wrappers("module._orig_mod.model.lm_head.weight") == "lm_head.weight"
    assert strip_wrappers("module") == "module"


@pytest.mark.parametrize("wrap", [None, "module", "_orig_mod"])
def test_a_model_is_routed_by_its_modules(wrap, native):
    model = Unrevealing()
    routed = model if wrap is None else Wrapper(model, wrap)
    prefix = "" if wrap is None else wrap + "."
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the modules tell everything: no warning
        opt = normuon.NorMuonAdamW(routed)
    rows = table(opt)
    assert rows[prefix + "table.weight"]["role"] == "embedding"
    assert rows[prefix + "out.weight"]["role"] == "head"
    assert "Embedding" in rows[prefix + "table.weight"]["why"]
    assert "maps onto the vocabulary (50)" in rows[prefix + "out.weight"]["why"]
    assert adamw_names(opt) == {prefix + n for n in ("table.weight", "mix.bias", "out.weight", "out.bias")}
    # The same model by names alone: the names hide both, and a warning says so, with the routing.
    with pytest.warns(UserWarning, match=r"'table.weight', 'out.weight' went to NorMuon on their names alone"
                                         r"(.|\n)*The routing:\nNorMuonAdamW: 5 parameters"):
        by_name = normuon.NorMuonAdamW(Unrevealing().named_parameters())
    assert table(by_name)["out.weight"]["algorithm"] == "normuon"


@pytest.mark.parametrize("tied", [False, True])
def test_min_gpt_with_and_without_tying(tied, native):
    model = Wrapper(MinGPT(tied=tied))
    opt = normuon.NorMuonAdamW(model)
    rows = table(opt)
    expected = {"module.tok_emb.weight", "module.pos_emb", "module.blocks.0.bias", "module.blocks.2.bias",
                "module.ln_f.weight", "module.ln_f.bias"} | (set() if tied else {"module.head.weight"})
    assert adamw_names(opt) == expected
    assert rows["module.pos_emb"]["why"] == "rule: embedding (name)"  # a bare Parameter: its name decides
    if tied:
        assert "module.head.weight" not in rows  # one tensor, one entry: the embedding
    assert {n for n, r in rows.items() if r["algorithm"] == "normuon"} == {"module.blocks.0.weight",
                                                                           "module.blocks.2.weight"}


def test_decay_groups_of_plain_tensors_warn_and_model_fixes_them(native):
    # The usual decay / no-decay split hands over plain tensors: before, the embedding and the head went to
    # NorMuon without a word.
    model = MinGPT()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    with pytest.warns(UserWarning, match="matrices without names"):
        normuon.NorMuonAdamW(groups)
    groups = [{"params": iter(decay), "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = normuon.NorMuonAdamW(groups, model=model)
    rows = table(opt)
    assert rows["tok_emb.weight"]["algorithm"] == rows["head.weight"]["algorithm"] == "adamw"
    assert rows["blocks.0.weight"]["algorithm"] == "normuon" and rows["blocks.0.weight"]["group"] == "group0_normuon"
    assert opt.param_groups[[g["name"] for g in opt.param_groups].index("group0_normuon")]["weight_decay"] == 0.1


def test_explicit_normuon_and_adamw_params(native):
    model = MinGPT()
    hidden = [p for n, p in model.named_parameters() if n.startswith("blocks") and p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if not (n.startswith("blocks") and p.dim() == 2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = normuon.NorMuonAdamW(normuon_params=hidden, adamw_params=rest, lr=0.01, adamw_lr=1e-3)
    assert [(g["name"], g["algorithm"], len(g["params"])) for g in opt.param_groups] == [
        ("normuon", "normuon", 2), ("adamw", "adamw", 7)]
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[1]["lr"] == 1e-3
    named = normuon.NorMuonAdamW(normuon_params=[(n, p) for n, p in model.named_parameters()
                                                 if n.startswith("blocks") and p.dim() == 2],
                                 adamw_params=rest, model=model)
    assert table(named)["blocks.0.weight"]["why"] == "group 'normuon'" and "tok_emb.weight" in table(named)
    with pytest.raises(ValueError, match="either params or normuon_params= / adamw_params=, not both"):
        normuon.NorMuonAdamW(model, normuon_params=hidden)
    with pytest.raises(TypeError, match="needs params"):
        normuon.NorMuonAdamW()
    with pytest.raises(ValueError, match="NorMuon needs a 2-D matrix"):
        normuon.NorMuonAdamW(normuon_params=[model.ln_f.weight])
    with pytest.raises(TypeError, match="model= must be a torch.nn.Module"):
        normuon.NorMuonAdamW(model.named_parameters(), model=[1])


def test_several_layers_onto_the_vocabulary_take_the_one_named_head(native):
    class TwoOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(40, 8)
            self.aux = nn.Linear(8, 40)
            self.lm_head = nn.Linear(8, 40)

    with pytest.warns(UserWarning, match=r"2 layers map onto the vocabulary of 40 .*'lm_head' is taken"):
        opt = normuon.NorMuonAdamW(TwoOut())
    rows = table(opt)
    assert rows["lm_head.weight"]["role"] == "head" and rows["aux.weight"]["algorithm"] == "normuon"


def test_roles_and_overrides_still_win_over_the_modules(native):
    opt = normuon.NorMuonAdamW(Unrevealing(), roles={"mix.weight": "embedding"}, overrides={"out.weight": "normuon"})
    rows = table(opt)
    assert rows["mix.weight"]["algorithm"] == "adamw" and rows["mix.weight"]["why"] == "rule: embedding (roles=)"
    assert rows["out.weight"]["algorithm"] == "normuon" and rows["out.weight"]["why"] == "override"


def test_distributed_wrapper_prints_the_routing_with_owners(tmp_path, native):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method="file://" + str(tmp_path / "store"), rank=0, world_size=1)
    try:
        opt = normuon.DistributedNorMuonAdamW(Wrapper(Unrevealing()), threads=1)
        rows = {r["name"]: r for r in opt.routing_table()}
        out = io.StringIO()
        opt.print_routing(file=out)
    finally:
        dist.destroy_process_group()
    assert rows["module.out.weight"]["role"] == "head" and rows["module.mix.weight"]["owner"] == 0
    assert rows["module.table.weight"]["owner"] == "all"
    text = out.getvalue()
    assert text.startswith("DistributedNorMuonAdamW: 5 parameters") and "owner" in text.splitlines()[1]


@pytest.mark.parametrize("tied", [False, True])
def test_a_position_table_larger_than_the_vocabulary_does_not_make_a_hidden_matrix_the_head(tied, native):
    # Char-level nanoGPT: wpe (256 positions) is larger than the vocabulary (65), and c_fc maps 64 -> 256:
    # the largest embedding was taken as the vocabulary and c_fc became the "head", on AdamW, silently.
    class CharGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(65, 64)
            self.wpe = nn.Embedding(256, 64)
            self.c_fc = nn.Linear(64, 256)
            self.c_proj = nn.Linear(256, 64)
            self.lm_head = nn.Linear(64, 65, bias=False)
            if tied:
                self.lm_head.weight = self.wte.weight

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = table(normuon.NorMuonAdamW(CharGPT()))
    assert rows["c_fc.weight"]["algorithm"] == "normuon" and rows["c_proj.weight"]["algorithm"] == "normuon"
    if not tied:
        assert rows["lm_head.weight"]["role"] == "head"


def test_the_name_warning_takes_the_same_token_embedding_as_the_modules(native):
    # By names, the largest embedding was taken for the token table: a position table larger than the
    # vocabulary (char-level nanoGPT) made a hidden matrix of its shape a "lookalike".
    torch.manual_seed(0)
    named = [("wte.weight", nn.Parameter(torch.randn(65, 64))), ("wpe.weight", nn.Parameter(torch.randn(256, 64))),
             ("h.0.c_fc.weight", nn.Parameter(torch.randn(256, 64))),
             ("h.0.c_proj.weight", nn.Parameter(torch.randn(64, 256)))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        normuon.NorMuonAdamW(named)
    with pytest.warns(UserWarning, match="'unnamed.weight' went to NorMuon on their names alone"):
        normuon.NorMuonAdamW(named + [("unnamed.weight", nn.Parameter(torch.randn(65, 64)))])
