"""Contract tests of normuon.megatron.MegatronAdamW, the AdamW for Megatron's Adam groups, without Megatron.
Numbers as in test_megatron_contract.py: 1 Megatron-shaped groups and the scheduler,
2 the Float16 wrapper's swap, 3 the DistributedOptimizer's 1-D shards, 4 the DistributedOptimizer's load
(group step, or one shared per-parameter step tensor), 5 LayerWise narrowing, 6 parameter-shaped checkpoint
state, 7 step counters. The oracle is spec.adamw_update (the spec's AdamW, what torch >= 2.0 computes)
at TE FusedAdam's step t = group['step']; agreement with torch.optim.AdamW is checked at the tolerance
docs/python.md states."""
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")

import spec_oracle as spec  # noqa: E402
from normuon.megatron import MegatronAdamW, MegatronNorMuon  # noqa: E402
from megatron_helpers import megatron_groups, random_params, scheduler_step, set_grads  # noqa: E402
from conftest import require_exact_torch_sqrt, torch_addcmul_fuses, torch_sqrt_rounding_errors  # noqa: E402


SHAPES = [(6, 5), (17,), (0,), (4, 3, 2), ()]


def make_params(seed=0, shapes=SHAPES, dtype=torch.float32):
    return random_params(shapes, seed, dtype)


def grads_for(params, step, seed=5, skip=()):
    g = torch.Generator().manual_seed(seed * 7919 + step)
    return [None if k in skip else torch.randn(p.shape, generator=g) for k, p in enumerate(params)]


def build(params_or_groups, backend, **kw):
    kw.setdefault("lr", 1e-2)
    kw.setdefault("betas", (0.9, 0.95))
    kw.setdefault("weight_decay", 0.1)
    return MegatronAdamW(params_or_groups, backend=backend, **kw)


def hyper(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
    return dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)


class Oracle:
    """spec.adamw_update per parameter on fp32 copies, at the step t the caller gives (TE's rule: the
    group's step, whether or not this parameter had a gradient before)."""

    def __init__(self, params):
        self.p = [p.detach().float().clone() for p in params]
        self.m = [torch.zeros(p.shape) for p in params]
        self.v = [torch.zeros(p.shape) for p in params]

    def step(self, grads, hypers, t):
        for k, grad in enumerate(grads):
            if grad is not None:
                spec.adamw_update(self.p[k], grad.float(), self.m[k], self.v[k], hypers[k], t)


def assert_matches(opt, params, oracle, indices=None):
    for k in indices if indices is not None else range(len(params)):
        p = params[k]
        s = opt.state[p]
        assert set(s) == {"exp_avg", "exp_avg_sq"}, k  # exactly DistOpt's optimizer_state_keys
        assert torch.equal(p.detach().float(), oracle.p[k]), f"parameter {k}"
        assert torch.equal(s["exp_avg"], oracle.m[k]), f"exp_avg {k}"
        assert torch.equal(s["exp_avg_sq"], oracle.v[k]), f"exp_avg_sq {k}"


# ------------------------------------------------------------------------------------------------ 1

def test_1_megatron_groups_scheduler_and_per_group_eps(backend):
    """Megatron's groups survive with their keys; lr (float, then a tensor the scheduler fill_()s) and
    weight_decay written between steps take effect; MuP's per-group eps is used; the bias correction
    follows the group step even for a parameter that missed a step."""
    params = make_params()
    opt = build(megatron_groups(params[:2], params[2:], eps=1e-6), backend, lr=None)
    oracle = Oracle(params)
    lr_tensor = torch.tensor(0.0)
    for t, (lr, wd) in enumerate([(1e-2, 0.1), (5e-3, 0.05), (2e-3, 0.2), (1e-3, 0.1)], start=1):
        scheduler_step(opt, t, lr, wd, lr_tensor)
        grads = grads_for(params, t, skip={1} if t == 2 else ())
        set_grads(params, grads)
        opt.step()
        oracle.step(grads, [hyper(lr, weight_decay=wd * (k < 2), eps=1e-8 if k < 2 else 1e-6)
                            for k in range(len(params))], t)
        assert_matches(opt, params, oracle)
    keys = {"is_expert_parallel", "default_config", "wd_mult", "lr_mult", "is_decoupled_lr", "max_lr", "min_lr"}
    for g, saved in zip(opt.param_groups, opt.state_dict()["param_groups"]):
        assert keys <= set(g) and keys <= set(saved) and saved["bias_correction"] is True
    assert [g.get("step") for g in opt.param_groups] == [4, None, 4]  # the empty group never steps


def test_1_bad_values_are_refused_before_anything_changes(backend):
    params = make_params()
    opt = build([{"params": params}], backend)
    set_grads(params, grads_for(params, 1))
    opt.step()
    before = [p.detach().clone() for p in params]
    for key, value, message in [("lr", float("nan"), r"lr=nan is not a finite number"),
                                ("betas", (1.0, 0.9), r"betas\[0\]=1.0 is outside \[0, 1\)"),
                                ("betas", (0.9,), r"betas=\(0.9,\) is not a pair"),
                                ("eps", "x", "eps='x' is not a number"),
                                ("weight_decay", -1.0, "weight_decay=-1.0 is outside"),
                                ("bias_correction", False, "bias_correction=False: only bias-corrected")]:
        good = opt.param_groups[0][key]
        opt.param_groups[0][key] = value
        with pytest.raises(ValueError, match=r"MegatronAdamW: param_groups\[0\]: " + message):
            opt.step()
        opt.param_groups[0][key] = good
        assert all(torch.equal(a, b.detach()) for a, b in zip(before, params))
        assert opt.param_groups[0]["step"] == 1


@pytest.mark.parametrize("kwargs,message", [
    (dict(amsgrad=True), "AMSGrad is not implemented"),
    (dict(adam_w_mode=False), "only decoupled weight decay"),
    (dict(bias_correction=False), "only bias-corrected"),
    (dict(capturable=True), "CUDA graph"),
    (dict(master_weights=True), "precision-aware"),
    (dict(exp_avg_dtype=torch.bfloat16), "exp_avg_dtype=torch.bfloat16: .*precision-aware"),
    (dict(use_decoupled_grad=True), "precision-aware"),
    (dict(maximize=True), "only minimisation"),
    (dict(backend="gpu"), "unknown backend 'gpu'"),
    (dict(nonfinite="ignore"), "nonfinite='ignore'"),
])
def test_unsupported_options_are_refused_with_the_reason(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MegatronAdamW(make_params(), **kwargs)


def test_te_and_torch_keywords_are_accepted():
    """Megatron's TE call (adam_w_mode, capturable=False) and torch's (foreach, fused); set_grad_none only
    picks zero_grad's default."""
    params = make_params()
    MegatronAdamW(params, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, capturable=False,
                  adam_w_mode=True, backend="reference")
    opt = MegatronAdamW(params, 1e-3, (0.9, 0.99), 1e-8, 0.0, False, foreach=False, fused=None,
                        set_grad_none=False, backend="reference")
    set_grads(params, grads_for(params, 1))
    opt.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in params)
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params)


# ----------------------------------------------------------------------------------------- vs torch

def torch_pair(betas, backend):
    params = make_params(seed=1)
    ours = [p.detach().clone().requires_grad_() for p in params]
    theirs = [p.detach().clone().requires_grad_() for p in params]
    h = dict(lr=1e-3, eps=1e-8, weight_decay=0.01)
    return (ours, MegatronAdamW(ours, betas=betas, backend=backend, **h),
            theirs, torch.optim.AdamW(theirs, betas=betas, foreach=False, **h))


def test_bitwise_with_torch_adamw_when_the_moment_forms_coincide(backend):
    """beta1 = 0: torch 1.13's m.mul_(b1).add_(g, alpha=1-b1) and the spec's lerp both give m = g, so the
    rest (decay, v, bias corrections, addcdiv) must match bit for bit (docs/python.md, Agreement)."""
    require_exact_torch_sqrt()
    ours, opt, theirs, torch_opt = torch_pair((0.0, 0.999), backend)
    for t in range(1, 9):
        grads = grads_for(ours, t)
        set_grads(ours, grads)
        set_grads(theirs, grads)
        opt.step()
        torch_opt.step()
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), t


def test_agrees_with_torch_adamw_within_the_documented_tolerance(backend):
    """betas (0.9, 0.999): step 1 bit-identical, exp_avg_sq bit-identical, parameters within rtol 2e-6."""
    ours, opt, theirs, torch_opt = torch_pair((0.9, 0.999), backend)
    for t in range(1, 11):
        grads = grads_for(ours, t)
        set_grads(ours, grads)
        set_grads(theirs, grads)
        opt.step()
        torch_opt.step()
        if t == 1 and torch_sqrt_rounding_errors() == 0:
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
        if torch_addcmul_fuses():  # else torch's own v rounds twice (ATEN_CPU_CAPABILITY=default)
            assert torch.equal(opt.state[a]["exp_avg_sq"], torch_opt.state[b]["exp_avg_sq"])
        torch.testing.assert_close(opt.state[a]["exp_avg"], torch_opt.state[b]["exp_avg"], rtol=0, atol=1e-6)
    sd = opt.state_dict()["state"]
    assert all(float(sd[i]["step"]) == float(torch_opt.state[b]["step"]) == 10 for i, b in enumerate(theirs))


# ------------------------------------------------------------------------------------------------ 2

def test_2_float16_wrapper_swaps_in_fp32_copies(backend):
    """Built on bf16 model parameters, then each replaced by an fp32 clone with its state moved along: the
    step updates the fp32 copies only."""
    model = make_params(seed=2, dtype=torch.bfloat16)
    opt = build(megatron_groups(model[:2], model[2:]), backend)
    main = []
    for g in opt.param_groups:
        for i, p in enumerate(g["params"]):
            fp32 = p.detach().clone().float()
            g["params"][i] = fp32
            if p in opt.state:
                opt.state[fp32] = opt.state.pop(p)
            main.append(fp32)
    opt.load_state_dict(opt.state_dict())
    oracle = Oracle(main)
    for t in (1, 2):
        grads = grads_for(main, t)
        set_grads(main, grads)
        model_before = [p.detach().clone() for p in model]
        opt.step()
        assert all(torch.equal(a, b.detach()) for a, b in zip(model_before, model))
        oracle.step(grads, [hyper()] * len(main), t)
        assert_matches(opt, main, oracle)
    assert set(map(id, opt.state)) == set(map(id, main))


# ------------------------------------------------------------------------------------------------ 3

def test_3_distributed_optimizer_shards_are_bit_identical_to_the_whole(backend):
    """DistributedOptimizer: param_groups replaced by 1-D fp32 shard views that cut parameters (one empty),
    then load_state_dict(state_dict()) on empty state; its checkpoint code writes state in place
    (_set_main_param_and_optimizer_states). The shards follow the unsharded AdamW bit for bit."""
    full = make_params(seed=3, shapes=[(6, 5), (17,), (4, 4)])
    whole = build([{"params": full}], backend)
    model = [p.detach().clone().requires_grad_() for p in full]
    opt = build(megatron_groups(model[:2], model[2:]), backend)
    ranges = [(7, 23), (0, 17), (5, 5)]  # this rank's slices of each parameter (the last one empty)
    shards = [p.detach().view(-1)[a:b].clone().float() for p, (a, b) in zip(model, ranges)]
    shard_of = {id(p): s for p, s in zip(model, shards)}
    opt.param_groups = [dict(g, params=[shard_of[id(p)] for p in g["params"]]) for g in opt.param_groups]
    sd = opt.state_dict()
    assert sd["state"] == {}
    opt.load_state_dict(sd)
    for t in (1, 2, 3):
        grads = grads_for(full, t)
        set_grads(full, grads)
        set_grads(shards, [g.view(-1)[a:b].clone() for g, (a, b) in zip(grads, ranges)])
        whole.step()
        opt.step()
        for s, p, (a, b) in zip(shards, full, ranges):
            assert torch.equal(s, p.detach().view(-1)[a:b])
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[s][key], whole.state[p][key].view(-1)[a:b])
        if t == 2:  # load_parameter_state: the same values written into both, in place
            for s, p, (a, b) in zip(shards, full, ranges):
                for key in ("exp_avg", "exp_avg_sq"):
                    value = whole.state[p][key].view(-1)[a:b] * 0.5
                    opt.state[s][key].copy_(value)
                    whole.state[p][key].view(-1)[a:b].copy_(value)
    assert all(set(opt.state[s]) == {"exp_avg", "exp_avg_sq"} for s in shards)
    assert [g.get("step") for g in opt.param_groups] == [3, None, 3]


# ------------------------------------------------------------------------------------------------ 4

def megatron_adam_init_state_fn(opt, config=None):
    """Megatron's init_state_fn for Adam (_get_megatron_optimizer_based_on_param_groups)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if len(opt.state[p]) == 0:
                opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)


@pytest.mark.parametrize("variant", ["group_step", "shared_param_step", "both"])
def test_4_distributed_optimizer_load_keeps_the_bias_correction(backend, variant):
    """DistributedOptimizer.load_state_dict hands over only exp_avg / exp_avg_sq per parameter, with the step
    in the groups (TE/Apex installed) or, without them, one tensor object shared by every parameter's
    'step' (and the groups' step). The next steps must use t = 4, 5, 6 in the bias correction, the shared
    tensor must never be incremented in place (torch's AdamW advances an aliased step once per
    parameter), and the steps written back must be separate tensors."""
    params = make_params(seed=4)
    opt = build([{"params": params[:3], "wd_mult": 1.0}, {"params": params[3:], "wd_mult": 1.0}], backend)
    for t in (1, 2, 3):
        set_grads(params, grads_for(params, t))
        opt.step()
    sd = opt.state_dict()
    shared = torch.tensor(3.0)
    state = {i: {"exp_avg": s["exp_avg"].clone(), "exp_avg_sq": s["exp_avg_sq"].clone()}
             for i, s in sd["state"].items()}
    groups = [dict(g) for g in sd["param_groups"]]
    if variant != "group_step":
        for s in state.values():
            s["step"] = shared
    if variant == "shared_param_step":
        for g in groups:
            del g["step"]

    fresh = [p.detach().clone().requires_grad_() for p in params]
    other = build([{"params": fresh[:3], "wd_mult": 1.0}, {"params": fresh[3:], "wd_mult": 1.0}], backend,
                  lr=1.0, betas=(0.5, 0.5))
    megatron_adam_init_state_fn(other)
    other.load_state_dict({"state": state, "param_groups": groups})
    assert [g["step"] for g in other.param_groups] == [3, 3]
    for s in state.values():  # the loaded tensors were copied, not kept
        s["exp_avg"].fill_(1e3)
    oracle = Oracle(fresh)
    oracle.m = [opt.state[p]["exp_avg"].clone() for p in params]
    oracle.v = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    for t in (4, 5, 6):
        grads = grads_for(params, t)
        set_grads(params, grads)
        set_grads(fresh, grads)
        opt.step()
        other.step()
        oracle.step(grads, [hyper()] * len(params), t)
        assert_matches(other, fresh, oracle)
        assert all(torch.equal(a, b) for a, b in zip(params, fresh))  # == the uninterrupted run
    assert float(shared) == 3.0
    steps = [s["step"] for s in other.state_dict()["state"].values()]
    assert all(float(s) == 6.0 for s in steps) and len(set(map(id, steps))) == len(steps)


# ------------------------------------------------------------------------------------------------ 5

def test_5_layer_wise_narrowing_and_emptying(backend):
    params = make_params(seed=5)
    opt = build([{"params": params[:2]}, {"params": params[2:]}], backend)
    oracle = Oracle(params)
    for t in (1, 2):
        grads = grads_for(params, t)
        set_grads(params, grads)
        opt.step()
        oracle.step(grads, [hyper()] * len(params), t)
    opt.param_groups[0]["params"] = [params[1]]
    opt.param_groups[1]["params"] = []
    others = [params[k].detach().clone() for k in (0, 2, 3, 4)]
    grads = grads_for(params, 3)
    set_grads(params, grads)
    opt.step()
    oracle.step([None, grads[1], None, None, None], [hyper()] * len(params), 3)
    assert_matches(opt, params, oracle, indices=[1])
    assert all(torch.equal(a, params[k].detach()) for a, k in zip(others, (0, 2, 3, 4)))
    assert list(opt.state) == [params[1]]
    assert [g["step"] for g in opt.param_groups] == [3, 2]
    opt.param_groups[0]["params"] = []
    opt.step()
    assert len(opt.state) == 0 and opt.state_dict()["state"] == {}


# ------------------------------------------------------------------------------------------------ 6

def test_6_checkpoint_state_is_parameter_shaped_and_loads_are_checked(backend):
    params = make_params(seed=6) + make_params(seed=7, shapes=[(3, 5)], dtype=torch.bfloat16)
    opt = build([{"params": params}], backend)
    for t in (1, 2):
        set_grads(params, grads_for(params, t))
        opt.step()
    sd = opt.state_dict()
    for i, p in enumerate(params):
        s = sd["state"][i]
        assert set(s) == {"exp_avg", "exp_avg_sq", "step"} | ({"master_param"} if i == 5 else set())
        assert all(tuple(v.shape) == tuple(p.shape) and v.dtype == torch.float32 for k, v in s.items() if k != "step")
        assert s["step"].dim() == 0 and float(s["step"]) == 2.0

    ps = [p.detach().clone().requires_grad_() for p in params]
    other = build([{"params": ps}], backend)
    other.load_state_dict(sd)
    for p in (params, ps):
        set_grads(p, grads_for(params, 3))
    opt.step()
    other.step()
    assert all(torch.equal(a, b) for a, b in zip(params, ps))

    ps = [p.detach().clone().requires_grad_() for p in params]
    other = build([{"params": ps}], backend)
    bad = {"param_groups": sd["param_groups"], "state": {i: dict(s) for i, s in sd["state"].items()}}
    first = sd["state"][0]
    for broken, message in [(dict(first, exp_avg=torch.zeros(5, 6)), r"exp_avg has shape \(5, 6\), expected \(6, 5\)"),
                            (dict(first, momentum_buffer=torch.zeros(6, 5)), "has keys"),
                            ({"exp_avg": first["exp_avg"]}, "has keys"),
                            (dict(first, exp_avg_sq=torch.zeros(6, 5, dtype=torch.int32)), "not a floating-point")]:
        bad["state"][1] = dict(sd["state"][1])
        bad["state"][0] = broken
        with pytest.raises(ValueError, match=message):
            other.load_state_dict(bad)
        assert all(float(v.abs().sum()) == 0 for s in other.state_dict()["state"].values()
                   for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))


# ------------------------------------------------------------------------------------------------ 7

def test_7_step_counters_follow_te_and_agree_across_chained_optimizers(backend):
    """group['step'] advances in every group with parameters on every step, with or without gradients (TE's
    rule, which ChainedOptimizer._synchronize_steps needs across the Adam and Muon optimizers); the
    per-parameter steps in the state dict are equal (FP32Optimizer's _extract_common_per_param_step); a
    skipped step (nonfinite='skip_step') advances nothing."""
    vectors = make_params(seed=8)
    matrices = [torch.randn(8, 4, requires_grad=True), torch.randn(4, 8, requires_grad=True)]
    adam = build([{"params": vectors[:2]}, {"params": []}, {"params": vectors[2:]}], backend, nonfinite="skip_step")
    muon = MegatronNorMuon([{"params": matrices}], backend=backend, coefficient_type="simple",
                           fp32_matmul_prec="highest")
    for t in (1, 2, 3):
        set_grads(vectors, grads_for(vectors, t) if t != 2 else [None] * len(vectors))
        set_grads(matrices, grads_for(matrices, t))
        adam.step()
        muon.step()
    steps = {g["step"] for o in (adam, muon) for g in o.param_groups if g["params"]}  # _synchronize_steps
    assert steps == {3}
    per_param = {float(s["step"]) for s in adam.state_dict()["state"].values()}
    assert per_param == {3.0}
    before = [p.detach().clone() for p in vectors]
    grads = grads_for(vectors, 4)
    grads[0][0, 0] = float("nan")
    set_grads(vectors, grads)
    adam.step()
    assert adam.last_skip_reason is not None and [g.get("step") for g in adam.param_groups] == [3, None, 3]
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, vectors))


def test_megatron_init_state_then_step(backend):
    """Megatron's Adam init_state_fn puts zero tensors into opt.state before any step (checkpoint load path);
    they are adopted, and the first step matches the spec."""
    params = make_params(seed=9)
    opt = build([{"params": params}], backend)
    megatron_adam_init_state_fn(opt)
    oracle = Oracle(params)
    grads = grads_for(params, 1)
    set_grads(params, grads)
    opt.step()
    oracle.step(grads, [hyper()] * len(params), 1)
    assert_matches(opt, params, oracle)
