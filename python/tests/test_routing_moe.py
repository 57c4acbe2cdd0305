"""Mixture-of-experts models as transformers 5.x builds them (tiny, from their configs, random weights; nothing is
downloaded): their routers take the router role and go to AdamW, by their modules or by their names alone; their
expert banks go to NorMuon, each expert stepped as a matrix of its own; overrides= / roles= take glob patterns to
move them (or anything else) by the layer."""
import io
import warnings

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (scripts/setup.sh puts it "
                                                          "in the torch 2.x environment)")

import normuon  # noqa: E402
from normuon.routing import expand_patterns, router_roles  # noqa: E402


def mixtral():
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


def qwen2_moe():
    config = transformers.Qwen2MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                         shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    return transformers.Qwen2MoeForCausalLM(config)


def deepseek_v3():
    config = transformers.DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                           n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                           first_k_dense_replace=0, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                           qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1)
    return transformers.DeepseekV3ForCausalLM(config)


ROUTERS = {  # model: its routers in layer 0 (every layer has them)
    mixtral: ["model.layers.0.mlp.gate.weight"],
    qwen2_moe: ["model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight"],
    deepseek_v3: ["model.layers.0.mlp.gate.weight"],
}


def rows_of(opt):
    return {r["name"]: r for r in opt.routing_table()}


@pytest.mark.parametrize("make", list(ROUTERS), ids=lambda m: m.__name__)
@pytest.mark.parametrize("given", ["model", "names"])
def test_routers_go_to_adamw_by_their_role(make, given, native):
    torch.manual_seed(0)
    model = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the names-only form may warn about the head; not what is tested)
        opt = normuon.NorMuonAdamW(model if given == "model" else model.named_parameters(), threads=1)
    rows = rows_of(opt)
    routers = [n for n in rows if rows[n]["role"] == "router"]
    assert routers == [n for n in rows if any(n == r.replace("layers.0", f"layers.{k}") for r in ROUTERS[make]
                                              for k in range(2))]
    for name in routers:
        assert rows[name]["algorithm"] == "adamw", rows[name]
        assert rows[name]["why"].startswith("rule: router (") and "experts'" in rows[name]["why"], rows[name]["why"]
    # Nothing else moved: the shared experts' and attention's matrices stay on NorMuon.
    assert all(r["algorithm"] == "normuon" for n, r in rows.items() if n.endswith(("q_proj.weight", "o_proj.weight",
                                                                                   "shared_expert.gate_proj.weight")))
    text = io.StringIO()
    opt.print_routing(file=text)
    assert "router" in text.getvalue()


def test_router_rule_needs_experts_beside_it():
    names = ["a.mlp.gate.weight", "a.mlp.experts.gate_up_proj", "b.mlp.gate.weight", "b.mlp.up.weight",
             "c.moe.router.gate.weight", "c.moe.experts.w1", "d.block_sparse_moe.gate.weight",
             "d.block_sparse_moe.experts.0.w1.weight", "e.mlp.gate_proj.weight", "e.mlp.experts.down_proj",
             "f.mlp.shared_experts.gate.weight"]
    assert sorted(router_roles(names)) == ["a.mlp.gate.weight", "c.moe.router.gate.weight",
                                           "d.block_sparse_moe.gate.weight"]
    assert router_roles(names)["c.moe.router.gate.weight"] == ("router", "'c.moe.router' beside 'c.moe.experts'")


def test_overrides_and_roles_take_glob_patterns(native):
    model = mixtral()
    opt = normuon.NorMuonAdamW(model, threads=1, overrides={"*.mlp.gate.weight": "normuon",
                                                           "model.layers.1.mlp.gate.weight": "adamw"})
    rows = rows_of(opt)
    assert rows["model.layers.0.mlp.gate.weight"]["algorithm"] == "normuon"  # the pattern
    assert rows["model.layers.0.mlp.gate.weight"]["why"] == "override"
    assert rows["model.layers.1.mlp.gate.weight"]["algorithm"] == "adamw"    # an exact name wins over it
    opt = normuon.NorMuonAdamW(model, threads=1, roles={"*.self_attn.[qk]_proj.weight": "router"})
    rows = rows_of(opt)
    assert {n for n, r in rows.items() if r["role"] == "router" and "self_attn" in n} == {
        f"model.layers.{k}.self_attn.{p}_proj.weight" for k in range(2) for p in "qk"}


def test_a_pattern_that_matches_nothing_is_refused(native):
    model = mixtral()
    with pytest.raises(ValueError, match=r"overrides pattern '\*\.router\.weight' matches no parameter"):
        normuon.NorMuonAdamW(model, overrides={"*.router.weight": "adamw"})
    with pytest.raises(ValueError, match=r"roles pattern 'encoder\.\*' matches no parameter"):
        normuon.NorMuonAdamW(model, roles={"encoder.*": "matrix"})


def test_expand_patterns_order():
    names = ["x.a", "x.b", "y.a"]
    got = expand_patterns({"*.a": 1, "x.*": 2, "x.b": 3, "missing": 4}, names, "overrides")
    assert got == {"x.a": 1, "y.a": 1, "x.b": 3, "missing": 4}  # first pattern, then exact names (checked later)
    # A name that holds a pattern's characters (an expert's "w[0]") is itself, not a pattern.
    assert expand_patterns({"w[0]": 5, "w[01]": 6}, ["w[0]", "w0", "w1"], "roles") == {"w[0]": 5, "w0": 6, "w1": 6}


def test_a_router_added_later_is_still_a_router(native):
    """add_param_group: the router's experts are among the parameters already there."""
    model = mixtral()
    named = dict(model.named_parameters())
    gate = "model.layers.0.mlp.gate.weight"
    opt = normuon.NorMuonAdamW([(n, p) for n, p in named.items() if n != gate], model=model, threads=1)
    opt.add_param_group({"params": [named[gate]]})
    row = rows_of(opt)[gate]
    assert row["role"] == "router" and row["algorithm"] == "adamw", row


def test_tensors_of_three_dimensions_routed_by_the_rule_are_named(native):
    """Outside an experts module a 3-D tensor's name cannot tell a bank from a conv kernel: the rule sends it to
    AdamW, which a warning names; saying what it is ends it."""
    w = torch.nn.Parameter(torch.randn(4, 8, 8))
    with pytest.warns(UserWarning, match=r"'moe\.w_in' \(3 or more dimensions\) went to AdamW by the rule"):
        normuon.NorMuonAdamW([("moe.w_in", w), ("moe.proj.weight", torch.nn.Parameter(torch.randn(8, 8)))])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = normuon.NorMuonAdamW([("moe.w_in", w)], threads=1, roles={"*.w_in": "experts"})
    assert rows_of(opt)["moe.w_in"]["why"] == "rule: expert bank (roles=)"


@pytest.mark.parametrize("make", list(ROUTERS), ids=lambda m: m.__name__)
def test_moe_models_step_their_banks_as_separate_matrices_would_be(make, native):
    """Each model's expert banks go to NorMuon, and every expert is stepped bit for bit as the same matrix is
    as a 2-D parameter of its own (the same gradients, from the model's loss)."""
    torch.manual_seed(0)
    model = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left unexplained: banks, routers, embeddings, head
        opt = normuon.NorMuonAdamW(model, threads=2)
    rows = rows_of(opt)
    banks = [n for n, r in rows.items() if r["role"] == "experts"]
    assert banks and all(rows[n]["algorithm"] == "normuon" and len(rows[n]["shape"]) == 3 for n in banks)
    assert all(r["algorithm"] == "normuon" for n, r in rows.items() if ".experts." in n)
    # The same values, every bank as its experts (2-D parameters, matrices), the other roles as the model said.
    named = dict(model.named_parameters())
    split, roles = [], {}
    for n, p in named.items():
        if n in banks:
            split += [(f"{n}[{k}]", torch.nn.Parameter(p.detach()[k].clone())) for k in range(p.shape[0])]
        else:
            split.append((n, torch.nn.Parameter(p.detach().clone())))
            roles[n] = rows[n]["role"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (its experts' names alone look like a vocabulary; not what is tested)
        other = normuon.NorMuonAdamW(split, roles=roles, threads=2)
    tensors = dict(split)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
        for n, p in named.items():
            if n in banks:
                for k in range(p.shape[0]):
                    tensors[f"{n}[{k}]"].grad = p.grad[k].clone()
            else:
                tensors[n].grad = None if p.grad is None else p.grad.clone()
        opt.step()
        other.step()
        opt.zero_grad()
        for n, p in named.items():
            if n in banks:
                assert all(torch.equal(p.detach()[k], tensors[f"{n}[{k}]"].detach()) for k in range(p.shape[0])), n
            else:
                assert torch.equal(p.detach(), tensors[n].detach()), n
