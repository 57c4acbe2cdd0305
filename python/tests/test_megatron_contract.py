"""Contract tests of normuon.megatron without Megatron: they replay
the call sequences of Megatron's wrappers on plain torch and check what Megatron relies on. Numbers in the
test names are contract numbers: 1 Megatron-shaped groups and the scheduler, 2 the Float16
wrapper's parameter swap, 3 the DistributedOptimizer-style swap (as far as it applies to a matrix
optimizer), 5 LayerWise narrowing, 6 parameter-shaped checkpoint state, 7 step counters, 8 resume
determinism, 10 registration against a stub megatron.core module tree. 4 is AdamW's: MegatronAdamW's
contract tests are in test_megatron_adamw.py; per-block QKV and tensor parallelism (9) in
test_megatron_split.py."""
import io
import math
import sys
import types
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Optional

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")

from normuon import native  # noqa: E402
import spec_oracle as spec  # noqa: E402
from normuon.megatron import MegatronNorMuon, init_state_fn  # noqa: E402
import normuon.megatron as nm  # noqa: E402
from megatron_helpers import random_params, scheduler_step, set_grads  # noqa: E402
from megatron_helpers import megatron_groups as megatron_shaped_groups  # noqa: E402


SHAPES = [(16, 8), (8, 16), (12, 12), (24, 4)]


def make_params(seed=0, shapes=SHAPES, dtype=torch.float32):
    return random_params(shapes, seed, dtype)


def grads_for(params, step, seed=3, skip=()):
    """Deterministic fp32 gradients with per-row gains; indices in `skip` get none."""
    g = torch.Generator().manual_seed(seed * 7919 + step)
    out = []
    for k, p in enumerate(params):
        grad = torch.randn(p.shape, generator=g) * torch.logspace(-1, 1, p.shape[0]).unsqueeze(1)
        out.append(None if k in skip else grad)
    return out


def megatron_groups(params_a, params_b):
    """Megatron-shaped groups (megatron_helpers) with an optimizer key and a weight-decay schedule."""
    return megatron_shaped_groups(params_a, params_b, empty_extra=dict(optimizer="normuon"), start_wd=0.0,
                                  end_wd=0.1)


def spec_hypers(lr, wd, momentum=0.95, beta2=0.95, eps=1e-8, nesterov=True, lr_scale="official",
                ns_precision="bf16"):
    """The spec's values that MegatronNorMuon's documented mapping gives (written out here by hand)."""
    return dict(native.defaults("normuon"), lr=lr, weight_decay=wd, beta1=momentum, beta2=beta2,
                denom_eps=eps, nesterov=nesterov, ns_coefficients="quintic", ns_precision=ns_precision,
                reduce_axis="longer_dim", lr_scale=lr_scale, weight_decay_mode="decoupled",
                eps_placement="clamp")


class Oracle:
    """spec.normuon_update per parameter on fp32 copies: the spec, applied one matrix at a time.

    Against the reference backend the comparison is exact. The fast backend agrees with the reference bit for
    bit on the elementwise parts, but its bf16 Newton-Schulz GEMMs may round differently (bf16 resolution,
    data-dependent); so with it the tests run fp32 Newton-Schulz ('highest') and compare at the tolerance
    test_agreement.py sets for that mode."""

    def __init__(self, params, backend):
        self.backend = backend
        self.p = [p.detach().float().clone() for p in params]
        self.M = [torch.zeros(p.shape) for p in params]
        self.v = [torch.zeros(p.shape[0] if p.shape[0] >= p.shape[1] else p.shape[1]) for p in params]

    def step(self, grads, hypers):
        for k, grad in enumerate(grads):
            if grad is not None:
                p = self.p[k]
                h = dict(hypers[k], ns_precision=NS_PRECISION[self.backend])
                spec.normuon_update(p, grad.float(), self.M[k], self.v[k], h, p.shape[0] >= p.shape[1])


MATMUL_PREC = {"reference": "medium", "fast": "highest"}  # Megatron's names: bf16 and fp32 Newton-Schulz
NS_PRECISION = {"reference": "bf16", "fast": "fp32"}


def state_of(opt, p):
    s = opt.state[p]
    return s["momentum_buffer"].clone(), s["moment2_buffer"].clone()


def assert_matches_oracle(opt, params, oracle, indices=None):
    exact = oracle.backend == "reference"

    def same(a, b):
        return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-7)

    for k in indices if indices is not None else range(len(params)):
        p = params[k]
        assert same(p.detach().float(), oracle.p[k]), f"parameter {k}"
        momentum, moment2 = state_of(opt, p)
        assert torch.equal(momentum, oracle.M[k]), f"momentum {k}"  # elementwise: exact on both backends
        assert same(moment2.reshape(-1), oracle.v[k]), f"moment2 {k}"


def build(params_or_groups, backend, **kw):
    kw.setdefault("scale_mode", "shape_scaling")  # the spec's 'official' factor: no folded constant
    kw.setdefault("coefficient_type", "simple")
    kw.setdefault("fp32_matmul_prec", MATMUL_PREC[backend])
    return MegatronNorMuon(params_or_groups, backend=backend, **kw)


# ------------------------------------------------------------------------------------------------ 1

def test_1_megatron_groups_keep_their_keys_and_follow_the_scheduler(backend):
    """Megatron's groups (extra keys, an empty group, a wd_mult=0 group) survive; lr and weight_decay written
    between steps take effect, as floats and as a one-element tensor that the scheduler fill_()s."""
    params = make_params()
    groups = megatron_groups(params[:2], params[2:])
    opt = build(groups, backend, lr=None, weight_decay=0.1, momentum=0.9, beta2=0.9, eps=1e-8)
    oracle = Oracle(params, backend)
    schedule = [(1e-2, 0.1), (5e-3, 0.05), (2e-3, 0.2), (0.0, 0.1)]
    lr_tensor = torch.tensor(0.0)
    for t, (lr, wd) in enumerate(schedule, start=1):
        scheduler_step(opt, t, lr, wd, lr_tensor)
        grads = grads_for(params, t, skip={1} if t == 2 else ())
        set_grads(params, grads)
        opt.step()
        lr_used = float(lr_tensor) if t >= 3 else lr
        hypers = [spec_hypers(lr_used, wd * (1.0 if k < 2 else 0.0), momentum=0.9, beta2=0.9) for k in range(4)]
        oracle.step(grads, hypers)
        assert_matches_oracle(opt, params, oracle)
    keys = {"is_expert_parallel", "default_config", "wd_mult", "lr_mult", "is_decoupled_lr", "max_lr", "min_lr"}
    for g, saved in zip(opt.param_groups, opt.state_dict()["param_groups"]):
        assert keys <= set(g) and keys <= set(saved)
    assert opt.param_groups[1]["optimizer"] == "normuon" and opt.param_groups[2]["end_wd"] == 0.1
    assert [g.get("step") for g in opt.param_groups] == [4, None, 4]  # the empty group never steps


def test_1_bad_group_values_are_refused_before_anything_changes(backend):
    params = make_params()
    opt = build([{"params": params}], backend, lr=1e-2)
    set_grads(params, grads_for(params, 1))
    opt.step()
    before = [p.detach().clone() for p in params]
    for key, value, message in [("lr", float("nan"), r"lr=nan is not a finite number"),
                                ("lr", 2e6, r"lr=2000000.0 is outside \[0, 1e\+06\]"),
                                ("momentum", 1.5, r"momentum=1.5 is outside \[0, 1\)"),
                                ("lr", torch.ones(2), r"lr is a tensor of shape \(2,\), not a scalar"), ("eps", "x", "eps=.x. is not a number"),
                                ("lr", None, "lr=None is not a number")]:
        good = opt.param_groups[0][key]
        opt.param_groups[0][key] = value
        with pytest.raises(ValueError, match=r"param_groups\[0\]: " + message):
            opt.step()
        opt.param_groups[0][key] = good
        assert all(torch.equal(a, b.detach()) for a, b in zip(before, params))
        assert opt.param_groups[0]["step"] == 1


def test_1_a_refused_folded_value_names_the_groups_value_and_the_fold():
    # The ranges are the core's (one check); a value the fold pushes out of range says so.
    params = make_params()
    opt = build([{"params": params}], "reference", scale_mode="spectral", lr=1e6)  # folded: x 1/0.2
    set_grads(params, grads_for(params, 1))
    with pytest.raises(ValueError, match=r"param_groups\[0\]: lr=1000000.0 \(as 5000000.0, times the folded "
                                         r"scale 5\) is outside \[0, 1e\+06\]"):
        opt.step()
    assert opt.param_groups[0].get("step", 0) == 0


@pytest.mark.parametrize("scale_mode,extra", [("spectral", 1.0), ("spectral", 0.2), ("unit_rms_norm", 1.0),
                                              ("shape_scaling", 0.5)])
def test_1_scale_modes_follow_megatron_formula(backend, scale_mode, extra):
    """An independent float64 transcription of what the Megatron names mean: p <- p (1 - lr wd) - lr * extra *
    S(m, n) * NorMuon(O), with S the Emerging-Optimizers scale (spectral sqrt(max(m, n)), unit_rms_norm
    sqrt(m/n), shape_scaling sqrt(max(1, m/n))), the Keller quintic, per-longer-dim statistics, eps clamped."""
    params = make_params(seed=4)
    lr, wd, momentum, beta2, eps = 2e-3, 0.1, 0.9, 0.95, 1e-8
    opt = MegatronNorMuon([{"params": params}], backend=backend, lr=lr, weight_decay=wd, momentum=momentum,
                          nesterov=True, beta2=beta2, eps=eps, coefficient_type="simple", scale_mode=scale_mode,
                          extra_scale_factor=extra, fp32_matmul_prec="highest")
    P = [p.detach().double().clone() for p in params]
    M = [torch.zeros_like(x) for x in P]
    V = [None] * len(P)
    for t in (1, 2):
        grads = grads_for(params, t)
        set_grads(params, grads)
        opt.step()
        for k, grad in enumerate(grads):
            g = grad.double()
            m, n = g.shape
            M[k] = M[k] + (1 - momentum) * (g - M[k])
            U = g + momentum * (M[k] - g)
            X = U.t() if m > n else U
            X = X / (X.norm() + 1e-7)
            for _ in range(5):
                A = X @ X.t()
                X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
            O = X.t() if m > n else X
            r = O.square().mean(dim=1 if m >= n else 0)
            V[k] = (1 - beta2) * r if V[k] is None else V[k] + (1 - beta2) * (r - V[k])
            s = V[k].clamp_min(eps).rsqrt()
            N = O * (s.unsqueeze(1) if m >= n else s.unsqueeze(0))
            N = N * (O.norm() / (N.norm() + 1e-10))
            S = {"spectral": math.sqrt(max(m, n)), "unit_rms_norm": math.sqrt(m / n),
                 "shape_scaling": math.sqrt(max(1.0, m / n))}[scale_mode]
            expected = P[k] * (1 - lr * wd) - lr * extra * S * N
            got = params[k].detach().double()
            delta = expected - P[k]  # a wrong factor is an O(1) relative error; fp32 rounding is far below
            tolerance = 1e-3 * delta.abs().max() + 2e-7 * P[k].abs().max()
            assert (got - expected).abs().max() <= tolerance, (scale_mode, extra, k, t)
            P[k] = got.clone()  # follow our trajectory, so each step is checked on its own


# ------------------------------------------------------------------------------------------------ 2

def test_2_float16_wrapper_swaps_in_fp32_copies(backend):
    """Float16OptimizerWithFloat16Params: the optimizer is built on the bf16 model parameters, then each is
    replaced in its group by an fp32 clone, state moved along; the step updates the fp32 copies only, and
    the wrapper copies them back into the model."""
    model = make_params(seed=1, dtype=torch.bfloat16)
    opt = build(megatron_groups(model[:2], model[2:]), backend, lr=1e-2, weight_decay=0.05)
    init_state_fn(opt)  # Megatron may initialise state before the swap (checkpoint load path)
    main = []
    for g in opt.param_groups:
        for i, p in enumerate(g["params"]):
            fp32 = p.detach().clone().float()
            g["params"][i] = fp32
            if p in opt.state:
                opt.state[fp32] = opt.state.pop(p)
            main.append(fp32)
    opt.load_state_dict(opt.state_dict())  # the legacy wrapper's re-cast of the state
    oracle = Oracle(main, backend)
    for t in (1, 2, 3):
        grads = grads_for(main, t)
        set_grads(main, grads)
        model_before = [p.detach().clone() for p in model]
        opt.step()
        assert all(torch.equal(a, b.detach()) for a, b in zip(model_before, model))  # model untouched
        for p, q in zip(model, main):  # _copy_main_params_to_model_params
            p.data.copy_(q.data)
        oracle.step(grads, [spec_hypers(1e-2, 0.05)] * 4)  # no scheduler: wd_mult is not applied
        assert_matches_oracle(opt, main, oracle)
    assert set(map(id, opt.state)) == set(map(id, main))  # no state left on the bf16 tensors


def test_2_state_moves_with_a_swap_after_steps(backend):
    """A swap after some steps (state moved with state.pop, as the wrapper and offload/restore do) keeps the
    trajectory: the new tensors continue from the old state."""
    params = make_params(seed=2)
    opt = build([{"params": params}], backend, lr=1e-2)
    oracle = Oracle(params, backend)
    h = [spec_hypers(1e-2, 0.01)] * 4  # weight_decay defaults to Megatron's 0.01
    for t in (1, 2):
        grads = grads_for(params, t)
        set_grads(params, grads)
        opt.step()
        oracle.step(grads, h)
    clones = [p.detach().clone() for p in params]
    for i, (p, c) in enumerate(zip(params, clones)):
        opt.param_groups[0]["params"][i] = c
        opt.state[c] = opt.state.pop(p)
    for t in (3, 4):
        grads = grads_for(clones, t)
        set_grads(clones, grads)
        opt.step()
        oracle.step(grads, h)
    assert_matches_oracle(opt, clones, oracle)
    # State replaced by new tensors in place of the live views (as torch's own load does) is adopted too.
    momentum = [opt.state[c]["momentum_buffer"].clone() for c in clones]
    for c in clones:
        opt.state[c] = {k: v.clone() * 1.0 for k, v in opt.state[c].items()}
    set_grads(clones, [None] * 4)
    opt.step()  # no gradients: nothing moves, but the adopted values are what the state holds
    assert all(torch.equal(m, opt.state[c]["momentum_buffer"]) for m, c in zip(momentum, clones))
    assert opt.param_groups[0]["step"] == 5


# ------------------------------------------------------------------------------------------------ 3

def test_3_group_replacement_and_state_round_trip_on_empty_state(backend):
    """DistributedOptimizer replaces optimizer.param_groups wholesale (new dicts holding fp32 copies) and then
    runs load_state_dict(state_dict()) on empty state; the next step matches the spec on the copies and
    leaves the originals alone."""
    params = make_params(seed=5)
    originals = [p.detach().clone() for p in params]
    opt = build(megatron_groups(params[:2], params[2:]), backend, lr=1e-2)
    copies = [p.detach().clone() for p in params]
    copy_of = {id(p): c for p, c in zip(params, copies)}
    opt.param_groups = [dict(g, params=[copy_of[id(p)] for p in g["params"]]) for g in opt.param_groups]
    sd = opt.state_dict()
    assert sd["state"] == {}
    opt.load_state_dict(sd)
    oracle = Oracle(copies, backend)
    grads = grads_for(copies, 1)
    set_grads(copies, grads)
    opt.step()
    oracle.step(grads, [spec_hypers(1e-2, 0.01)] * 4)  # no scheduler ran: weight_decay is 0.01 everywhere
    assert_matches_oracle(opt, copies, oracle)
    assert all(torch.equal(a, p.detach()) for a, p in zip(originals, params))


def test_3_one_dimensional_shards_are_refused_clearly(backend):
    """The DistributedOptimizer's 1-D shard views (some 0-numel) cannot run NorMuon: a clear error, not a
    wrong update."""
    params = make_params(seed=6)
    opt = build([{"params": params}], backend, lr=1e-2)
    set_grads(params, grads_for(params, 1))
    opt.step()
    shards = [params[0].detach().view(-1)[3:40].clone(), params[1].detach().view(-1)[0:0].clone()]
    opt.param_groups = [dict(opt.param_groups[0], params=shards)]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] has shape \[37\]: NorMuon needs "
                                         r"whole 2-D matrices"):
        opt.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="NorMuon needs whole 2-D matrices"):
        MegatronNorMuon([shards[1]], coefficient_type="simple", backend=backend)
    # A MoE layer's experts in one 3-D weight: the flag that keeps them apart.
    with pytest.raises(ValueError, match=r"has shape \[4, 8, 6\].*without --moe-single-grouped-weight"):
        MegatronNorMuon([torch.nn.Parameter(torch.zeros(4, 8, 6))], coefficient_type="simple", backend=backend)


# ------------------------------------------------------------------------------------------------ 5

def test_5_layer_wise_narrowing_and_emptying(backend):
    """LayerWiseDistributedOptimizer.shard_params sets group['params'] to this rank's parameters, possibly
    none: the step touches only those, state exists only for them and continues where it was."""
    params = make_params(seed=7)
    opt = build([{"params": params[:2]}, {"params": params[2:]}], backend, lr=1e-2)
    oracle = Oracle(params, backend)
    h = [spec_hypers(1e-2, 0.01)] * 4
    for t in (1, 2):
        grads = grads_for(params, t)
        set_grads(params, grads)
        opt.step()
        oracle.step(grads, h)
    opt.param_groups[0]["params"] = [params[1]]
    opt.param_groups[1]["params"] = []
    others = [params[k].detach().clone() for k in (0, 2, 3)]
    grads = grads_for(params, 3)
    set_grads(params, grads)  # every rank has every gradient; only the local parameters are stepped
    opt.step()
    oracle.step([None, grads[1], None, None], h)
    assert_matches_oracle(opt, params, oracle, indices=[1])
    assert all(torch.equal(a, params[k].detach()) for a, k in zip(others, (0, 2, 3)))
    assert list(opt.state) == [params[1]]
    assert [g["step"] for g in opt.param_groups] == [3, 2]
    sd = opt.state_dict()
    assert [g["params"] for g in sd["param_groups"]] == [[0], []] and list(sd["state"]) == [0]
    opt.param_groups[0]["params"] = []
    opt.step()  # nothing to do, no error
    assert len(opt.state) == 0 and [g["step"] for g in opt.param_groups] == [3, 2]
    assert opt.state_dict()["state"] == {}


# ------------------------------------------------------------------------------------------------ 6

def test_6_checkpoint_state_is_parameter_shaped(backend):
    """make_sharded_optimizer_tensor asserts state.shape == param.shape for every key but 'step': the
    reduced second moment is expanded on save, and each of its forms loads back to the same state."""
    shapes = [(12, 4), (4, 12), (6, 6), (5, 1), (1, 5)]
    params = make_params(seed=8, shapes=shapes) + make_params(seed=9, shapes=[(8, 8)], dtype=torch.bfloat16)
    opt = build([{"params": params}], backend, lr=1e-2)
    for t in (1, 2):
        set_grads(params, grads_for(params, t))
        opt.step()
    sd = opt.state_dict()
    for i, p in enumerate(params):
        s = sd["state"][i]
        assert set(s) == ({"momentum_buffer", "moment2_buffer"} | ({"master_param"} if i == 5 else set()))
        assert all(tuple(v.shape) == tuple(p.shape) and v.dtype == torch.float32 for v in s.values())
        m, n = p.shape
        keep = (m, 1) if m >= n else (1, n)
        assert tuple(opt.state[p]["moment2_buffer"].shape) == keep  # Emerging-Optimizers' in-memory shape
        assert torch.equal(s["moment2_buffer"], opt.state[p]["moment2_buffer"].expand(m, n))

    def fresh():
        ps = make_params(seed=8, shapes=shapes) + make_params(seed=9, shapes=[(8, 8)], dtype=torch.bfloat16)
        for p, q in zip(ps, params):
            p.data.copy_(q.data)
        return ps, build([{"params": ps}], backend, lr=1e-2)

    def reduced(v, p, keepdim):
        m, n = p.shape
        r = v[:, 0] if m >= n else v[0, :]
        return (r.unsqueeze(1) if m >= n else r.unsqueeze(0)) if keepdim else r

    results = []
    for form in ("param", "reduced", "keepdim"):
        ps, o = fresh()
        d = {"param_groups": sd["param_groups"],
             "state": {i: dict(s, moment2_buffer=s["moment2_buffer"] if form == "param" else
                               reduced(s["moment2_buffer"], params[i], form == "keepdim"))
                       for i, s in sd["state"].items()}}
        o.load_state_dict(d)
        set_grads(ps, grads_for(ps, 3))
        o.step()
        results.append([p.detach().clone() for p in ps] + [v for s in o.state_dict()["state"].values()
                                                             for v in s.values()])
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[2]))

    ps, o = fresh()
    before = o.state_dict()
    bad = {"param_groups": sd["param_groups"], "state": {i: dict(s) for i, s in sd["state"].items()}}
    bad["state"][0]["moment2_buffer"] = bad["state"][0]["moment2_buffer"].clone()
    bad["state"][0]["moment2_buffer"][3, 2] += 1.0
    with pytest.raises(ValueError, match="not constant along each row"):
        o.load_state_dict(bad)
    bad["state"][0] = dict(sd["state"][0], moment2_buffer=torch.zeros(3))
    with pytest.raises(ValueError, match=r"moment2_buffer has shape \(3,\); expected \(12,\), \(12, 1\)"):
        o.load_state_dict(bad)
    bad["state"][0] = dict(sd["state"][0], exp_avg=torch.zeros(12, 4))
    with pytest.raises(ValueError, match="has keys"):
        o.load_state_dict(bad)
    assert before["state"] == {} and o.state_dict()["state"].keys() == sd["state"].keys()
    assert all(float(v.abs().sum()) == 0 for s in o.state_dict()["state"].values()
               for k, v in s.items() if k != "master_param")


# ------------------------------------------------------------------------------------------------ 7

def test_7_step_counters(backend):
    """group['step'] is a Python int advanced once per step() in every group with parameters, gradients or
    not (TE FusedAdam's rule, on which ChainedOptimizer._synchronize_steps relies); no per-parameter step."""
    params = make_params(seed=10)
    opt = build([{"params": params[:1]}, {"params": params[1:2]}, {"params": []}], backend, lr=1e-2)
    before = [p.detach().clone() for p in params]
    set_grads(params, [None] * 4)
    opt.step()
    assert [g.get("step") for g in opt.param_groups] == [1, 1, None]
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, params))
    assert all(float(v.abs().sum()) == 0 for s in opt.state.values() for v in s.values())
    set_grads(params, grads_for(params, 1, skip={1}))
    opt.step()
    assert [g.get("step") for g in opt.param_groups] == [2, 2, None]
    assert all(type(g["step"]) is int for g in opt.param_groups[:2])
    assert torch.equal(before[1], params[1].detach()) and not torch.equal(before[0], params[0].detach())

    def synchronize_steps(optimizers):  # ChainedOptimizer._synchronize_steps, as the notes describe it
        steps = {g["step"] for o in optimizers for g in o.param_groups if len(g["params"]) > 0 and "step" in g}
        assert len(steps) <= 1, steps
        return steps.pop() if steps else None

    adam_like = SimpleNamespace(param_groups=[{"params": [torch.zeros(3)], "step": 2}])  # TE FusedAdam after 2
    assert synchronize_steps([opt, adam_like]) == 2
    sd = opt.state_dict()
    assert all("step" not in s for s in sd["state"].values())  # _extract_common_per_param_step: nothing to disagree

    # Load: the group's step wins; without one, a per-parameter step (DistOpt's torch fallback shares one
    # tensor object between parameters) is taken when all agree.
    other = build([{"params": params[:1]}, {"params": params[1:2]}, {"params": []}], backend, lr=1e-2)
    other.load_state_dict(sd)
    assert [g.get("step") for g in other.param_groups] == [2, 2, None]
    shared = torch.tensor(7.0)
    no_group_step = {"param_groups": [{k: v for k, v in g.items() if k != "step"} for g in sd["param_groups"]],
                     "state": {i: dict(s, step=shared) for i, s in sd["state"].items()}}
    other.load_state_dict(no_group_step)
    assert [g.get("step") for g in other.param_groups] == [7, 7, None]
    assert type(other.param_groups[0]["step"]) is int
    no_group_step["param_groups"][0]["step"] = -1
    with pytest.raises(ValueError, match=r"step=-1 is not a non-negative integer"):
        other.load_state_dict(no_group_step)
    assert [g.get("step") for g in other.param_groups] == [7, 7, None]


# ------------------------------------------------------------------------------------------------ 8

def _run(backend, steps_first, steps_then, resume):
    params = make_params(seed=11)
    opt = build(megatron_groups(params[:2], params[2:]), backend, lr=1e-2, weight_decay=0.1)

    def train(ps, o, first, count):
        for t in range(first, first + count):
            for g in o.param_groups:
                g["lr"] = 1e-2 * (0.8 ** t)
                g["weight_decay"] = 0.1 * g["wd_mult"]
            set_grads(ps, grads_for(ps, t, skip={t % 4}))
            o.step()

    train(params, opt, 1, steps_first)
    if not resume:
        train(params, opt, 1 + steps_first, steps_then)
        return params, opt
    blob = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob)
    params2 = make_params(seed=12)  # different values: everything must come from the checkpoint
    for p, q in zip(params2, saved["params"]):
        p.data.copy_(q)
    opt2 = build(megatron_groups(params2[:2], params2[2:]), backend, lr=1.0, weight_decay=0.0)
    init_state_fn(opt2)  # Megatron's load path: state first, then load into it
    opt2.load_state_dict(saved["opt"])
    assert [g.get("step") for g in opt2.param_groups] == [steps_first, None, steps_first]
    train(params2, opt2, 1 + steps_first, steps_then)
    return params2, opt2


def test_8_resume_is_bit_exact_and_runs_repeat(backend):
    """N steps, torch.save, M steps == load into a fresh optimizer, M steps: parameters and every state
    tensor bit-equal; and two uninterrupted runs are bit-equal (run-to-run determinism)."""
    a_params, a_opt = _run(backend, 3, 3, resume=False)
    b_params, b_opt = _run(backend, 3, 3, resume=True)
    c_params, c_opt = _run(backend, 3, 3, resume=False)
    for x_params, x_opt in ((b_params, b_opt), (c_params, c_opt)):
        assert all(torch.equal(p.detach(), q.detach()) for p, q in zip(a_params, x_params))
        sa, sx = a_opt.state_dict(), x_opt.state_dict()
        assert sa["state"].keys() == sx["state"].keys()
        assert all(torch.equal(sa["state"][i][k], sx["state"][i][k]) for i in sa["state"] for k in sa["state"][i])
        assert [g.get("step") for g in sa["param_groups"]] == [g.get("step") for g in sx["param_groups"]]


# ------------------------------------------------------------------------------------------- init state

def test_init_state_fn_creates_state_for_every_parameter(backend):
    """Megatron's _eopt_init_state_fn: _init_group(group, skip_non_grad_params=False) for every group, before
    any step or gradient; zero state in Emerging-Optimizers' shapes, parameter-shaped in the state dict."""
    params = make_params(seed=13)
    opt = build(megatron_groups(params[:2], params[2:]), backend, lr=1e-2)
    assert len(opt.state) == 0 and opt.state_dict()["state"] == {}
    init_state_fn(opt)
    assert set(map(id, opt.state)) == set(map(id, params))
    for p in params:
        m, n = p.shape
        s = opt.state[p]
        assert tuple(s["momentum_buffer"].shape) == (m, n)
        assert tuple(s["moment2_buffer"].shape) == ((m, 1) if m >= n else (1, n))
    assert len(opt.state_dict()["state"]) == 4


# -------------------------------------------------------------------------------------------- rejections

class FakeGroup:
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


@pytest.mark.parametrize("kwargs,message", [
    (dict(moment2_method="adamuon"), "runs NorMuon only"),
    (dict(use_decoupled_weight_decay=False), "only decoupled weight decay"),
    (dict(coefficient_type="quintic"), "five different triples.*use 'simple'"),
    (dict(coefficient_type="polar_express"), "eight triples"),
    (dict(coefficient_type="cans"), "coefficient_type='cans' is not supported"),
    (dict(fp32_matmul_prec="lowest"), "fp32_matmul_prec='lowest': choose low | medium | high | highest"),
    (dict(verdict="later"), "verdict='later': choose sync | deferred"),
    (dict(num_ns_steps=0), r"num_ns_steps=0 is not an integer in \[1, 100\]"),  # the core's range
    (dict(num_ns_steps=True), "num_ns_steps=True is not a number"),
    (dict(num_ns_steps=None), r"^MegatronNorMuon: .*ns_steps"),  # a refusal that names no value keeps the label
    (dict(nesterov="yes"), "nesterov='yes' is not a boolean"),
    (dict(nonfinite="never"), "nonfinite='never'.*choose error | skip_step"),
    (dict(scale_mode="rms"), "scale_mode='rms'"),
    (dict(extra_scale_factor=0.0), "extra_scale_factor=0.0"),
    (dict(tp_mode="ring"), "tp_mode='ring'"),
    (dict(qkv_split_shapes=[4, 0, 2]), r"qkv_split_shapes=\[4, 0, 2\] is not a list of positive integers"),
    (dict(backend="gpu"), "unknown backend 'gpu'"),
])
def test_unsupported_values_are_refused_with_the_reason(kwargs, message):
    kwargs = dict(dict(coefficient_type="simple"), **kwargs)
    with pytest.raises(ValueError, match=message):
        MegatronNorMuon(make_params(), **kwargs)


def test_tp_one_and_any_tp_mode_are_accepted(backend):
    one = SimpleNamespace(tp=FakeGroup(1), expt_tp=FakeGroup(1))
    for mode in ("duplicated", "blockwise", "distributed"):
        build(make_params(), backend, pg_collection=one, tp_mode=mode, use_syrk=True)


@pytest.mark.parametrize("process_precision,expected", [("medium", "bf16"), ("high", "fp32"), ("highest", "fp32")])
def test_fp32_matmul_prec_low_follows_the_process_precision_as_megatron_does(process_precision, expected):
    # Megatron's CLI offers --muon-fp32-matmul-prec low; torch ignores 'low' (it keeps the current precision),
    # so Megatron's own Muon runs its Newton-Schulz at the process's float32 matmul precision. Before, the
    # adapter refused 'low' outright.
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision(process_precision)
        with pytest.warns(UserWarning, match=f"Newton-Schulz runs in {expected}"):
            opt = MegatronNorMuon(make_params(), coefficient_type="simple", fp32_matmul_prec="low",
                                  backend="reference")
    finally:
        torch.set_float32_matmul_precision(before)
    assert opt._fixed["ns_precision"] == expected and opt.fp32_matmul_prec == "low"
    assert nm.ns_precision_for("medium") == "bf16" and nm.ns_precision_for("highest") == "fp32"


def test_the_adapters_default_to_the_deferred_verdict_and_hand_it_on(backend):
    # On CUDA the NorMuon and Adam halves of a Megatron step then add no host sync between them (the verdict
    # of each is read from a status copy at its next step); on the CPU both verdicts are the same.
    params = make_params(seed=21)
    opt = build(params, backend)
    adam = nm.MegatronAdamW([torch.randn(5, requires_grad=True)], backend=backend)
    assert opt.verdict == adam.verdict == "deferred"
    set_grads(params, grads_for(params, 1))
    opt.step()
    assert opt.engine.verdict == "deferred"
    assert build(make_params(), backend, verdict="sync").verdict == "sync"


def test_a_deferred_skip_takes_back_the_step_counters(backend):
    # The verdict of a deferred step arrives at the next step(): a skipped step changed nothing, and the
    # counters step() advanced for it go back before the next step reads them. Simulated here by answering
    # for the engine as a deferred CUDA verdict would.
    params = make_params(seed=22)
    opt = build(params, backend, nonfinite="skip_step")
    set_grads(params, grads_for(params, 1))
    opt.step()
    assert [g["step"] for g in opt.param_groups] == [1]
    answers = iter(["nonfinite gradient in 'g0.p1'", None])
    opt.engine.settle = lambda: next(answers)
    opt.step()  # settles the first step as skipped (1 -> 0), then runs this one (0 -> 1)
    assert [g["step"] for g in opt.param_groups] == [1]
    assert opt.last_skip_reason == "nonfinite gradient in 'g0.p1'"  # reported, as NorMuonAdamW reports it
    opt.step()
    assert [g["step"] for g in opt.param_groups] == [2] and opt.last_skip_reason is None

    def fails():
        raise RuntimeError("nonfinite gradient in 'g0.p1'")
    opt.engine.settle = fails
    with pytest.raises(RuntimeError, match="nonfinite"):
        opt.state_dict()
    assert [g["step"] for g in opt.param_groups] == [1]


def test_non_matrices_are_refused():
    with pytest.raises(ValueError, match=r"has shape \[4\]: NorMuon needs whole 2-D matrices"):
        MegatronNorMuon([torch.zeros(4, requires_grad=True)], coefficient_type="simple", backend="reference")


# ------------------------------------------------------------------------------------------------ 10

class TensorParallelAdaptiveMuon:  # stands in for Megatron's class in the stub registry
    pass


@dataclass
class StubEntry:  # the fields of Megatron's EmergingOptimizerEntry
    optimizer_cls: type
    init_state_fn: Optional[Callable] = None
    config_to_kwargs: Optional[Callable] = None
    default_param_overrides: dict = field(default_factory=lambda: {"dataclass-default": {"optimizer": "adam"}})


MUON_OVERRIDES = {"nonlinear_or_embedding": {"optimizer": "adam"}}


def install_stub_megatron(monkeypatch, version="0.19.0", registry=True):
    """megatron, megatron.core, megatron.core.package_info, megatron.core.optimizer and
    megatron.core.optimizer.emerging_optimizers as bare modules with what register() reads."""
    megatron, core = types.ModuleType("megatron"), types.ModuleType("megatron.core")
    mopt = types.ModuleType("megatron.core.optimizer")
    eo = types.ModuleType("megatron.core.optimizer.emerging_optimizers")
    megatron.core, core.optimizer, mopt.emerging_optimizers = core, mopt, eo
    modules = {"megatron": megatron, "megatron.core": core, "megatron.core.optimizer": mopt,
               "megatron.core.optimizer.emerging_optimizers": eo}
    if version is None:
        monkeypatch.delitem(sys.modules, "megatron.core.package_info", raising=False)
    else:
        info = types.ModuleType("megatron.core.package_info")
        info.__version__ = version
        core.package_info = info
        modules["megatron.core.package_info"] = info
    if registry:
        eo.EmergingOptimizerEntry = StubEntry
        eo._EMERGING_OPTIMIZERS = {
            "muon": StubEntry(TensorParallelAdaptiveMuon, default_param_overrides=MUON_OVERRIDES),
            "adaptive_muon": StubEntry(TensorParallelAdaptiveMuon, default_param_overrides=MUON_OVERRIDES)}
    mopt.HAVE_EMERGING_OPTIMIZERS = False
    mopt.Adam, mopt.USING_PYTORCH_OPTIMIZER = torch.optim.AdamW, True  # no TE/Apex: Megatron's torch fallback
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return mopt, eo


def megatron_config(**overrides):
    """The OptimizerConfig fields the adapter reads, at Megatron's dataclass defaults unless overridden."""
    fields = dict(optimizer="normuon", lr=1e-3, min_lr=1e-4, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999,
                  adam_eps=1e-8, decoupled_weight_decay=True, muon_momentum=0.95, muon_split_qkv=True,
                  muon_nesterov=False, muon_scale_mode="spectral", muon_fp32_matmul_prec="medium",
                  muon_coefficient_type="quintic", muon_num_ns_steps=5, muon_tp_mode="blockwise",
                  muon_extra_scale_factor=1.0, adaptive_muon_moment2_method="adamuon", adaptive_muon_beta2=0.95,
                  adaptive_muon_eps=1e-8, muon_scalar_optimizer="adam")
    fields.update(overrides)
    return SimpleNamespace(**fields)


def test_10_register_into_a_stub_megatron_and_build_like_megatron(monkeypatch, backend):
    mopt, eo = install_stub_megatron(monkeypatch)
    entry = nm.register(backend=backend)
    assert eo._EMERGING_OPTIMIZERS["normuon"] is entry and entry.optimizer_cls is MegatronNorMuon
    assert entry.default_param_overrides is MUON_OVERRIDES  # Megatron's own Muon routing
    assert mopt.HAVE_EMERGING_OPTIMIZERS is True
    assert set(eo._EMERGING_OPTIMIZERS) == {"muon", "adaptive_muon", "normuon"}
    assert eo._EMERGING_OPTIMIZERS["adaptive_muon"].optimizer_cls is TensorParallelAdaptiveMuon
    assert nm.register(backend=backend).optimizer_cls is MegatronNorMuon  # idempotent

    # _create_emerging_optimizer: kwargs from the config, the class called with Megatron's groups.
    params = make_params(seed=14)
    params[0].is_qkv = True
    pg = SimpleNamespace(tp=FakeGroup(1), expt_tp=FakeGroup(1))
    config = megatron_config(muon_coefficient_type="simple", muon_split_qkv=False, muon_momentum=0.9,
                             muon_nesterov=True, muon_extra_scale_factor=0.2, adaptive_muon_beta2=0.9,
                             muon_fp32_matmul_prec=MATMUL_PREC[backend])
    kwargs = entry.config_to_kwargs(config, [SimpleNamespace(config=None)], pg)
    assert kwargs["momentum"] == 0.9 and kwargs["beta2"] == 0.9 and kwargs["nesterov"] is True
    assert kwargs["extra_scale_factor"] == 0.2 and kwargs["tp_mode"] == "blockwise" and "moment2_method" not in kwargs
    opt = entry.optimizer_cls(megatron_groups(params[:2], params[2:]), **kwargs)
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[0]["beta2"] == 0.9
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.pg_collection is pg
    entry.init_state_fn(opt, config)
    assert len(opt.state) == 4
    oracle = Oracle(params, backend)
    set_grads(params, grads_for(params, 1))
    opt.step()
    assert opt.backend == ("fast-cpu" if backend == "fast" else "reference-cpu")
    # spectral * 0.2 is the spec's rms_matching: no folded constant, so the spec oracle applies as is.
    oracle.step(grads_for(params, 1), [spec_hypers(1e-3, 0.01, momentum=0.9, beta2=0.9,
                                                   lr_scale="rms_matching")] * 4)
    assert_matches_oracle(opt, params, oracle)

    # Megatron's defaults fail closed, naming the flag to change.
    stock = entry.config_to_kwargs(megatron_config(), [None], pg)
    with pytest.raises(ValueError, match="--muon-coefficient-type simple"):
        entry.optimizer_cls(megatron_groups(params[:2], params[2:]), **stock)
    stock["coefficient_type"] = "simple"
    # split_qkv is on by default: a QKV weight needs its split shapes (Megatron tags p.qkv_split_shapes).
    with pytest.raises(ValueError, match="neither the parameter nor the optimizer has qkv_split_shapes"):
        entry.optimizer_cls(megatron_groups(params[:2], params[2:]), **stock)
    params[0].qkv_split_shapes = [2, 1, 1]  # 16 rows: 4 query groups of q, k, v rows
    opt = entry.optimizer_cls(megatron_groups(params[:2], params[2:]), **stock)
    set_grads(params, grads_for(params, 2))
    opt.step()
    assert opt.param_groups[0]["step"] == 1


def test_10_scalar_rerouting_applies_or_is_refused(monkeypatch):
    # Megatron applies --muon-scalar-optimizer only for the names 'muon' and 'adaptive_muon'. Registered as
    # 'normuon', a 'lion' request used to be dropped silently (the scalars got Adam); now it is refused.
    mopt, eo = install_stub_megatron(monkeypatch)
    entry = nm.register(backend="reference")
    pg = SimpleNamespace(tp=FakeGroup(1), expt_tp=FakeGroup(1))
    with pytest.raises(ValueError, match=r"muon_scalar_optimizer='lion'.*registered as 'normuon'.*name='muon'"):
        entry.config_to_kwargs(megatron_config(muon_scalar_optimizer="lion"), [None], pg)
    assert entry.config_to_kwargs(megatron_config(), [None], pg)["momentum"] == 0.95  # adam: as Megatron routes
    muon = nm.register("muon", replace_existing=True, backend="reference")
    assert muon.default_param_overrides is MUON_OVERRIDES  # Megatron rewrites their 'adam' for these names
    assert "momentum" in muon.config_to_kwargs(megatron_config(muon_scalar_optimizer="lion"), [None], pg)


def megatron_builds_adam(mopt, config, param_groups):
    """What _get_megatron_optimizer_based_on_param_groups does for config.optimizer == 'adam'."""
    kwargs = dict(params=param_groups, lr=config.lr, weight_decay=config.weight_decay,
                  betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, capturable=False)
    if mopt.USING_PYTORCH_OPTIMIZER:
        return torch.optim.AdamW(**kwargs)
    kwargs["adam_w_mode"] = config.decoupled_weight_decay
    return mopt.Adam(**kwargs)


def test_10_register_with_replace_adam(monkeypatch, backend):
    """register(replace_adam=True) also points Megatron's Adam at MegatronAdamW (module globals Adam and
    USING_PYTORCH_OPTIMIZER), so the Adam groups next to NorMuon run this project's AdamW."""
    mopt, eo = install_stub_megatron(monkeypatch)
    nm.register(backend=backend)
    assert mopt.Adam is torch.optim.AdamW and mopt.USING_PYTORCH_OPTIMIZER is True  # untouched by default
    nm.register(backend=backend, replace_adam=True)
    assert issubclass(mopt.Adam, nm.MegatronAdamW) and mopt.USING_PYTORCH_OPTIMIZER is False
    vectors = [torch.randn(5, requires_grad=True), torch.randn(3, 4, requires_grad=True)]
    adam = megatron_builds_adam(mopt, megatron_config(), megatron_groups(vectors[:1], vectors[1:]))
    assert isinstance(adam, nm.MegatronAdamW) and adam.defaults["betas"] == (0.9, 0.999)
    for p in vectors:
        p.grad = torch.ones_like(p)
    adam.step()
    assert adam.backend == ("fast-cpu" if backend == "fast" else "reference-cpu")
    assert [g.get("step") for g in adam.param_groups] == [1, None, 1]
    with pytest.raises(ValueError, match="adam_w_mode=False: only decoupled weight decay"):
        megatron_builds_adam(mopt, megatron_config(decoupled_weight_decay=False), [{"params": vectors}])
    assert nm.replace_adam(backend=backend).__name__ == "MegatronAdamW"

    mopt, eo = install_stub_megatron(monkeypatch)
    del mopt.USING_PYTORCH_OPTIMIZER
    with pytest.raises(RuntimeError, match="megatron.core.optimizer lacks USING_PYTORCH_OPTIMIZER"):
        nm.register(replace_adam=True)
    assert "normuon" not in eo._EMERGING_OPTIMIZERS and mopt.Adam is torch.optim.AdamW  # nothing touched


def test_10_registration_fails_closed(monkeypatch):
    for version, message in [("0.17.3", r"megatron-core 0.17.3 is outside the known-good range 0.18 to 0.20 "
                                         r"\(before 0.18 Megatron has no emerging-optimizer registry\)"),
                             ("0.21.0rc1", r"megatron-core 0.21.0rc1 is outside the known-good range"),
                             (None, r"cannot tell the megatron-core version \(found None\)")]:
        _, eo = install_stub_megatron(monkeypatch, version=version)
        with pytest.raises(RuntimeError, match=message):
            nm.register()
        assert "normuon" not in eo._EMERGING_OPTIMIZERS  # nothing touched
    install_stub_megatron(monkeypatch, version="0.17.3")  # the refusal names the call that made it
    with pytest.raises(RuntimeError, match=r"^normuon\.megatron\.replace_adam: megatron-core 0\.17\.3 is outside"):
        nm.replace_adam()
    _, eo = install_stub_megatron(monkeypatch, version="0.21.0")
    assert nm.register(allow_untested_version=True).optimizer_cls is MegatronNorMuon

    install_stub_megatron(monkeypatch, version="0.19.1", registry=False)
    with pytest.raises(RuntimeError, match=r"megatron-core 0.19.1: megatron.core.optimizer.emerging_optimizers "
                                           r"lacks _EMERGING_OPTIMIZERS, EmergingOptimizerEntry"):
        nm.register()

    _, eo = install_stub_megatron(monkeypatch, version="0.20.0")
    with pytest.raises(ValueError, match="'adaptive_muon' is already Megatron's TensorParallelAdaptiveMuon"):
        nm.register("adaptive_muon")
    assert eo._EMERGING_OPTIMIZERS["adaptive_muon"].optimizer_cls is TensorParallelAdaptiveMuon
    entry = nm.register("adaptive_muon", replace_existing=True)  # keep the stock --optimizer choice
    assert eo._EMERGING_OPTIMIZERS["adaptive_muon"] is entry and entry.default_param_overrides is MUON_OVERRIDES

    _, eo = install_stub_megatron(monkeypatch, version="0.18.0")

    @dataclass
    class RenamedEntry:  # a future layout of the entry: refused, registry untouched
        cls: type

    eo.EmergingOptimizerEntry = RenamedEntry
    with pytest.raises(RuntimeError, match=r"megatron-core 0.18.0: EmergingOptimizerEntry does not take"):
        nm.register()
    assert "normuon" not in eo._EMERGING_OPTIMIZERS

    monkeypatch.setitem(sys.modules, "megatron", None)
    for name in ("megatron.core", "megatron.core.optimizer", "megatron.core.optimizer.emerging_optimizers"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(RuntimeError, match="megatron-core is not importable"):
        nm.register()


def test_version_check_directly():
    nm.check_version("0.18.0")
    nm.check_version("0.20.0rc0")
    with pytest.raises(RuntimeError, match="0.15.2"):
        nm.check_version("0.15.2")
    nm.check_version("garbage", allow_untested_version=True)


def megatron_calls_per_step(cls, n_matrices, **kw):
    """Python-level calls inside one step() of a Megatron half over n_matrices parameters (sys.setprofile)."""
    import sys

    params = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(n_matrices)]
    opt = cls(params, backend="fast", **kw)
    calls = []
    for step in range(3):
        for p in params:
            p.grad = torch.full_like(p, 0.01 * (step + 1))
        if step < 2:
            opt.step()
    opt.state[params[0]]  # looked at, not changed
    sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_name if event == "call" else
                                                          getattr(arg, "__name__", str(arg)))
                   if event in ("call", "c_call") else None)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("half", ["normuon", "adamw"])
def test_a_megatron_step_walks_no_parameter_in_python(half):
    # The same Python calls for 10 parameters as for 1,000: which tensors the groups hold is told at C speed
    # (their ids), and whether anyone moved state by a flag the state's dicts keep (a full walk only then).
    cls, kw = (MegatronNorMuon, dict(coefficient_type="simple")) if half == "normuon" else (nm.MegatronAdamW, {})
    small, large = megatron_calls_per_step(cls, 10, **kw), megatron_calls_per_step(cls, 1000, **kw)
    assert len(small) == len(large), sorted(set(large) - set(small)) or (len(small), len(large))


def test_moved_state_is_still_adopted_after_steps_that_walked_nothing():
    params = make_params(seed=31)
    opt, twin = build(params, "fast"), build([p.detach().clone().requires_grad_() for p in params], "fast")
    for t in (1, 2):
        for o in (opt, twin):
            set_grads(o.param_groups[0]["params"], grads_for(params, t))
            o.step()
    opt.state[params[0]]["momentum_buffer"] = torch.zeros_like(params[0])  # replaced: adopted at the next step
    twin.state[twin.param_groups[0]["params"][0]]["momentum_buffer"].zero_()
    for o in (opt, twin):
        set_grads(o.param_groups[0]["params"], grads_for(params, 3))
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twin.param_groups[0]["params"]))
    assert opt.state[params[0]]["momentum_buffer"] is not None
