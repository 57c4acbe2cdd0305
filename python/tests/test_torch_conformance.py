"""NorMuonAdamW where PyTorch's own optimizer suite looks: the torch.optim conventions its generic tests pin.

PyTorch checks every optimizer it ships with one generic suite, TestOptimRenewed in its test/test_optim.py,
driven by an OptimizerInfo per optimizer (torch/testing/_internal/common_optimizers.py, which ships with torch;
test_optim.py does not). Here NorMuonAdamW gets such an OptimizerInfo, on the fast and the reference backends,
and each behaviour that suite checks is checked in our own words. The torch tests each case mirrors:

    test_errors ..................................... test_errors (get_error_inputs_for_all_optims' cases)
    test_input_forms_mean_what_they_mean_in_torch ... test_errors, and how torch's Optimizer reads params
    test_goes_right_direction ....................... test_forloop_goes_right_direction (contiguous or not,
                                                      with or without schedulers)
    test_param_group_with_lrscheduler_goes_right_direction ... the test of that name
    test_tensor_lr .................................. test_tensor_lr (num_dim 0, 1, 2)
    test_param_groups_weight_decay, test_param_groups_lr ..... the tests of those names
    test_step_is_noop_when_params_have_no_grad, test_step_is_noop_for_zero_grads,
    test_grads_are_never_inplaced_into, test_optimizer_can_be_printed, test_non_empty_state ... same names
    test_state_dict_deterministic ................... test_state_dict_deterministic (named or not, repeated groups)
    test_can_load_older_state_dict .................. test_can_load_older_state_dict, and this package's older
                                                      group key 'names'
    test_can_load_from_to_named_state_dict .......... test_can_load_from_to_named_state_dict
    test_save_load_equality_with_weights_only, test_load_nontensor_step ... same names
    test_state_dict_hooks ........................... test_state_dict_pre_hook / _post_hook / _pre_post_hook
    test_load_state_dict_hooks ...................... test_load_state_dict_pre_hook_and_prepend / _post_hook /
                                                      _pre_post_hook
    test_step_hooks ................................. test_step_pre_hook / _post_hook / _all_hooks
    test_deepcopy_and_pickle_are_refused ............ test_deepcopy_copies_all_public_attrs: refused by design
    test_strided_parameters_step_as_contiguous_twins, test_nonfinite_names_the_callers_element,
    test_param_groups_edited_by_hand, test_routing_difference_is_named ... what those tests touch, in depth

Not applicable here: foreach / fused / capturable / differentiable (the step is one fused native call), sparse
and complex parameters (refused), the CUDA-only and multi-GPU tests, LBFGS's closure tests. copy.deepcopy and
pickle are refused by design (docs/python.md): the state lives in native buffers bound to the model's tensors.

torch's helpers are private API: the suite is written for the torch scripts/setup.sh pins (2.11, whose helpers
need expecttest) and skips, saying why, where they are missing (Debian's torch 1.13).
"""
import copy
import functools
import io
import pickle
import re
import warnings

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")
if int(torch.__version__.split(".")[0]) < 2:
    pytest.skip(f"torch {torch.__version__}: torch's optimizer test helpers (common_optimizers) are torch 2's",
                allow_module_level=True)
try:
    from torch.testing._internal.common_optimizers import (ErrorOptimizerInput, OptimizerErrorEnum, OptimizerInfo,
                                                           OptimizerInput)
except ImportError as error:  # expecttest missing, or the private API moved
    pytest.skip(f"torch {torch.__version__}: its optimizer test helpers do not import ({error}); scripts/setup.sh "
                "installs what they need", allow_module_level=True)
from torch.nn import Parameter  # noqa: E402
from torch.optim.lr_scheduler import LinearLR, ReduceLROnPlateau, StepLR  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook  # noqa: E402

import normuon  # noqa: E402
from conftest import emulated_cuda_backend, require_native  # noqa: E402

BARE = "NorMuonAdamW got matrices without names"  # the warning for bare tensors, which these tests pass on purpose
pytestmark = pytest.mark.filterwarnings(f"ignore:{BARE}")


class NorMuonAdamWReference(normuon.NorMuonAdamW):
    """NorMuonAdamW on the reference backend, as a class: torch's tests build optimizers as optim_cls(params, **kw)."""

    def __init__(self, params=None, **kwargs):
        super().__init__(params, backend="reference", **kwargs)


def optim_inputs(device, dtype=None):
    """The configurations every case runs: the keywords users pass (torch's names where they mean the same)."""
    return [
        OptimizerInput(params=None, kwargs={}, desc="default"),
        OptimizerInput(params=None, kwargs={"lr": 0.01, "adamw_lr": 0.01}, desc="non-default lr"),
        OptimizerInput(params=None, kwargs={"lr": torch.tensor(0.001)}, desc="Tensor lr"),
        OptimizerInput(params=None, kwargs={"weight_decay": 0.1, "adamw_weight_decay": 0.1}, desc="weight_decay"),
        OptimizerInput(params=None, kwargs={"momentum": 0.9, "nesterov": False}, desc="momentum, no nesterov"),
        OptimizerInput(params=None, kwargs={"ns_steps": 3, "adamw_betas": (0.8, 0.99)}, desc="ns_steps, betas"),
    ]


def optim_error_inputs(device, dtype):
    """What is refused, with torch's words where torch refuses the same."""
    w, w2 = (Parameter(torch.randn(2, 3, device=device, dtype=dtype)) for _ in range(2))
    b = Parameter(torch.randn(3, device=device, dtype=dtype))
    non_leaf = torch.randn(2, 3, device=device, dtype=dtype, requires_grad=True) * 2
    complex_param = Parameter(torch.randn(2, 3, device=device, dtype=torch.complex64))

    def error(params, kwargs, error_type, regex, desc):
        return ErrorOptimizerInput(OptimizerInput(params=params, kwargs=kwargs, desc=desc), error_type=error_type,
                                   error_regex=regex, error_on=OptimizerErrorEnum.CONSTRUCTION_ERROR)

    iterable = "params argument given to the optimizer should be an iterable of Tensors or dicts"
    return [
        error(w, {}, TypeError, iterable, "a Parameter alone"),
        error(torch.randn(3, 4), {}, TypeError, iterable, "a tensor alone (not taken row by row)"),
        error({w, b}, {}, TypeError, "ordered collections", "a set"),
        error({"params": [w]}, {}, TypeError, r"pass a param group as \[\{'params': ...\}\]", "a group not in a list"),
        error([w, w], {}, ValueError, "a parameter group with duplicate parameters", "duplicates in a group"),
        error([{"params": w}, {"params": w}], {}, ValueError,
              "some parameters appear in more than one parameter group", "duplicates across groups"),
        error([w, b], dict(lr=torch.tensor([0.001, 0.001])), ValueError, "Tensor lr must be 1-element",
              "Tensor lr of two elements"),
        error([("weight", w), w2], {}, ValueError,
              "all optimizer params should be with/without names. Some param names are missing", "names in part"),
        error([{"params": [w], "lr": 1e-2}, {"params": [("weight", w2)]}], {}, ValueError,
              "all optimizer param groups should be with/without names. cannot add param group with names to the "
              "optimizer", "names in some groups"),
        error([w, b], dict(lr="fast"), ValueError, r"\('normuon', normuon\): option 'normuon.lr': 'fast' is not a "
              "number", "a string lr"),
        error([w, b], dict(lr=[0.1]), ValueError, r"\('normuon', normuon\): option 'lr': \[0.1\] \(list\) is not a "
              "number", "a list lr"),
        error([w, b], dict(adamw_betas=0.9), ValueError, r"adamw_betas=0.9 is not a pair", "betas not a pair"),
        error([{"params": [b], "algorithm": "adamw", "betas": 0.9}], {}, ValueError,
              r"param group #0: AdamW's betas=0.9 is not a pair", "a group's betas not a pair"),
        error([{"params": [b], "algorithm": "adamw", "eps": torch.tensor([1e-8, 1e-8])}], {}, ValueError,
              r"\('group0', adamw\): option 'eps': Tensor eps must be 1-element", "a group's Tensor eps"),
        error([w, b], dict(lr=-1.0), ValueError, r"option 'normuon.lr': -1 is outside", "a negative lr"),
        error([non_leaf], {}, ValueError, "can't optimize a non-leaf Tensor", "a non-leaf tensor"),
        error([complex_param], {}, ValueError, "NorMuonAdamW takes float32, bfloat16 or float16", "complex"),
    ]


INFOS = [OptimizerInfo(cls, optim_inputs_func=optim_inputs, optim_error_inputs_func=optim_error_inputs,
                       scheduler_inputs=([lambda opt: StepLR(opt, gamma=0.9, step_size=10),
                                          lambda opt: ReduceLROnPlateau(opt)],
                                         [lambda opt: LinearLR(opt, start_factor=0.4, total_iters=4)]),
                       supported_impls=(), not_og_supported_flags=(), supports_complex=False)
         for cls in (normuon.NorMuonAdamW, NorMuonAdamWReference)]


@pytest.fixture(params=INFOS, ids=["fast", "reference"])
def info(request):
    require_native()
    return request.param


def kwargs_of(info):
    """Fresh keywords of every configuration (a Tensor lr is mutated by schedulers: never shared)."""
    return [copy.deepcopy(i.kwargs) for i in info.optim_inputs_func(device="cpu")]


def assert_same(a, b, where="state dict"):
    """Equal structures, tensors bit for bit (dtype and shape too)."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (where, sorted(map(str, a)), sorted(map(str, b)))
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{k}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


def linear_loss(weight, bias, x):
    return (weight.mv(x) + bias).pow(2).sum()


# ------------------------------------------------------------------------------------------ input forms

def test_errors(info):
    for case in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
        given = case.optimizer_error_input
        with pytest.raises(case.error_type, match=case.error_regex):
            info.optim_cls(given.params, **given.kwargs)


def test_input_forms_mean_what_they_mean_in_torch(info):
    """A tensor in a group is that tensor (torch's add_param_group), a generator and named_parameters() are
    walked once, and a single tensor given as params is refused (it would be taken row by row, and a step would
    update views of its rows only)."""
    cls = info.optim_cls
    t = Parameter(torch.randn(3, 4))
    with pytest.raises(TypeError, match="iterable of Tensors or dicts"):
        cls(t)
    assert [g["params"] for g in cls([{"params": t}]).param_groups] == [[t]]
    assert [g["params"] for g in cls([t]).param_groups] == [[t]]
    model = torch.nn.Linear(4, 3)
    by_generator = cls(p for p in model.parameters())
    assert sum(len(g["params"]) for g in by_generator.param_groups) == 2
    assert all("param_names" not in g for g in by_generator.param_groups)  # bare tensors: no names, as torch
    named = cls(model.named_parameters())
    assert [n for g in named.param_groups for n in g["param_names"]] == ["weight", "bias"]
    t.grad = torch.ones_like(t)
    before = t.detach().clone()
    cls([t]).step()
    assert not torch.equal(t, before)  # the tensor itself was stepped


# ------------------------------------------------------------------------------------- steps and groups

@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("with_schedulers", [False, True])
def test_goes_right_direction(info, contiguous, with_schedulers):
    for schedulers in (info.scheduler_inputs if with_schedulers else [[]]):
        for kwargs in kwargs_of(info):
            if contiguous:
                weight, bias = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10))
            else:  # every other element of a larger tensor: neither contiguous nor dense
                weight, bias = Parameter(torch.randn(10, 5, 2)[..., 0]), Parameter(torch.randn(10, 2)[..., 0])
            x = torch.randn(5)
            opt = info.optim_cls([weight, bias], **kwargs)
            initial, final = _train(opt, schedulers, lambda: linear_loss(weight, bias, x))
            assert final < initial, kwargs


def _train(opt, schedulers, loss_of, steps=20):
    """(loss before, loss after) `steps` steps of opt with closures, the schedulers stepped after each."""
    scheds = [make(opt) for make in schedulers]

    def closure():
        opt.zero_grad()
        loss = loss_of()
        loss.backward()
        return loss

    initial = closure().item()
    for _ in range(steps):
        loss = opt.step(closure)
        for s in scheds:
            s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()
    return initial, closure().item()


def test_param_group_with_lrscheduler_goes_right_direction(info):
    for schedulers in info.scheduler_inputs:
        weight, weight2 = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10, 5))
        x = torch.randn(5)
        opt = info.optim_cls([{"params": [weight]}, {"params": [weight2], "lr": 0.01}])
        initial, final = _train(opt, schedulers, lambda: (weight.mv(x) + weight2.mv(x)).pow(2).sum())
        assert final < initial


@pytest.mark.parametrize("num_dim", [0, 1, 2])
def test_tensor_lr(info, num_dim):
    """A 1-element Tensor lr (any number of dimensions) steps exactly as the same float."""
    for kwargs in kwargs_of(info):
        kwargs.pop("lr", None)
        weight, bias = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10))
        weight_c, bias_c = (Parameter(p.detach().clone()) for p in (weight, bias))
        x = torch.randn(5)
        lr = torch.tensor(1e-3).reshape([1] * num_dim)
        opt_float = info.optim_cls([weight, bias], lr=1e-3, **kwargs)
        opt_tensor = info.optim_cls([weight_c, bias_c], lr=lr, **kwargs)
        for _ in range(5):
            for w, b, o in ((weight, bias, opt_float), (weight_c, bias_c, opt_tensor)):
                o.zero_grad()
                linear_loss(w, b, x).backward()
                o.step()
            assert torch.equal(weight, weight_c) and torch.equal(bias, bias_c)


def test_param_groups_weight_decay(info):
    for kwargs in kwargs_of(info):
        kwargs2 = dict(kwargs, weight_decay=0.0, adamw_weight_decay=0.0)
        weight, weight2 = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10, 5))
        x = torch.randn(5)
        opt = info.optim_cls([dict(params=[weight], **kwargs), dict(params=[weight2], **kwargs2)])
        initial = (weight.mv(x) + weight2.mv(x)).pow(2).sum().item()
        for _ in range(20):
            opt.zero_grad()
            loss = (weight.mv(x) + weight2.mv(x)).pow(2).sum()
            loss.backward()
            opt.step()
        assert loss.item() < initial


def test_param_groups_lr(info):
    """The group's own lr wins over the constructor's (1e-28 there: a parameter left to it does not move)."""
    for kwargs in kwargs_of(info):
        kwargs.setdefault("lr", 1e-3)
        kwargs.setdefault("adamw_lr", 1e-3)
        weight, bias = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10))
        irrelevant = Parameter(torch.randn(2, 2))
        before = irrelevant.detach().clone()
        x = torch.randn(5)
        opt = info.optim_cls([dict(params=[weight, bias], **kwargs), dict(params=[irrelevant])], lr=1e-28,
                             adamw_lr=1e-28, weight_decay=0.0)
        initial = linear_loss(weight, bias, x).item()
        for _ in range(20):
            opt.zero_grad()
            loss = linear_loss(weight, bias, x)
            loss.backward()
            irrelevant.grad = torch.rand_like(irrelevant)
            opt.step()
        assert loss.item() < initial
        assert torch.equal(irrelevant, before)


def test_step_is_noop_when_params_have_no_grad(info):
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    before = [p.detach().clone() for p in params]
    for kwargs in kwargs_of(info):
        opt = info.optim_cls(params, **kwargs)
        opt.step()
        assert all(torch.equal(p, b) for p, b in zip(params, before))
        assert all(g["step"] == 0 for g in opt.param_groups)


def test_step_is_noop_for_zero_grads(info):
    param = Parameter(torch.randn(5, 1))
    before = param.detach().clone()
    for kwargs in kwargs_of(info):
        if kwargs.get("weight_decay", 0) or kwargs.get("adamw_weight_decay", 0):
            continue  # decay moves parameters whatever the gradient
        opt = info.optim_cls([param], **dict(kwargs, weight_decay=0.0, adamw_weight_decay=0.0))
        param.grad = torch.zeros_like(param)
        opt.step()
        assert torch.equal(param, before)


def test_grads_are_never_inplaced_into(info):
    param = Parameter(torch.randn(5, 1))
    for kwargs in kwargs_of(info):
        opt = info.optim_cls([param], **kwargs)
        param.grad = torch.rand_like(param)
        version = param.grad._version
        for _ in range(5):
            opt.step()
            assert param.grad._version == version


def test_optimizer_can_be_printed(info):
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for kwargs in kwargs_of(info):
        assert type(info.optim_cls(params, **kwargs)).__name__ in repr(info.optim_cls(params, **kwargs))


def test_non_empty_state(info):
    model = torch.nn.Linear(5, 5, bias=False)
    for kwargs in kwargs_of(info):
        opt = info.optim_cls(model.parameters(), **kwargs)
        opt.zero_grad()
        model(torch.rand(2, 5)).sum().backward()
        opt.step()
        assert opt.state and all(len(s) > 0 for s in opt.state.values())
        assert all(int(s["step"]) == 1 for s in opt.state_dict()["state"].values())
        assert all(s["momentum_buffer"].abs().sum() > 0 for s in opt.state.values())


# ------------------------------------------------------------------------------------------ state dicts

def _step(opt, weight, bias, x):
    opt.zero_grad()
    linear_loss(weight, bias, x).backward()
    opt.step()


def _without_param_names(state_dict):
    out = copy.deepcopy(state_dict)
    for g in out["param_groups"]:
        g.pop("param_names", None)
    return out


def _named(params, named):
    return [(f"name{i}", p) for i, p in enumerate(params)] if named else params


@pytest.mark.parametrize("named0", [True, False])
@pytest.mark.parametrize("named1", [True, False])
def test_state_dict_deterministic(info, named0, named1):
    """A state dict loads into an optimizer over equal (not identical) parameters, named or not, and both then
    step and save alike; a repeated group is saved as the group it repeats."""
    for kwargs in kwargs_of(info):
        weight, bias, x = Parameter(torch.randn(2, 3)), Parameter(torch.randn(2)), torch.randn(3)
        opt = info.optim_cls(_named([weight, bias], named0), **kwargs)
        for _ in range(10):
            _step(opt, weight, bias, x)
        weight_c, bias_c = (Parameter(p.detach().clone()) for p in (weight, bias))
        opt_c = info.optim_cls(_named([weight_c, bias_c], named1), **kwargs)
        opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
        for _ in range(10):
            _step(opt, weight, bias, x)
            _step(opt_c, weight_c, bias_c, x)
            assert torch.equal(weight, weight_c) and torch.equal(bias, bias_c)
        mine, theirs = _without_param_names(opt.state_dict()), _without_param_names(opt_c.state_dict())
        assert_same(mine, theirs)
        opt_c.param_groups.extend(opt_c.param_groups)  # (torch's #36831)
        assert _without_param_names(opt_c.state_dict())["param_groups"][-1] == mine["param_groups"][-1]


def _conv_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 2, 1, stride=2), torch.nn.BatchNorm2d(2)), torch.rand(1, 4, 16, 16)


def _model_step(opt, model, x):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()


def _old_form(state_dict, generated):
    """A state dict as earlier versions wrote it: the group key 'names' (generated names, param0 ..., for bare
    tensors) and a split's empty half kept (an empty 'normuon' group first, as the C++ defaults order them)."""
    old = copy.deepcopy(state_dict)
    names = iter(f"param{k}" for k in range(1000))
    for g in old["param_groups"]:
        given = g.pop("param_names", None)
        g["names"] = [next(names) for _ in g["params"]] if generated or given is None else given
    if [g["name"] for g in old["param_groups"]] == ["adamw"]:
        empty = dict(old["param_groups"][0], name="normuon", algorithm="normuon", params=[], names=[], step=0)
        old["param_groups"].insert(0, empty)
    return old


def test_can_load_older_state_dict(info):
    """A state dict of earlier versions loads, named or not, and the run goes on bit for bit."""
    for kwargs in kwargs_of(info):
        for named in (True, False):
            model, x = _conv_model()
            opt = info.optim_cls(model.named_parameters() if named else model.parameters(), **kwargs)
            for _ in range(3):
                _model_step(opt, model, x)
            old = _old_form(opt.state_dict(), generated=not named)
            twin, _ = _conv_model()
            twin.load_state_dict(model.state_dict())
            again = info.optim_cls(twin.named_parameters() if named else twin.parameters(), **kwargs)
            again.load_state_dict(old)
            for _ in range(2):
                _model_step(opt, model, x)
                _model_step(again, twin, x)
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
            assert_same(_without_param_names(opt.state_dict()), _without_param_names(again.state_dict()))


def test_a_torch_adamw_state_dict_loads_by_position(info):
    """A model whose every parameter goes to AdamW has one group, as torch's AdamW: its state dict loads."""
    model, x = _conv_model()
    theirs = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        theirs.zero_grad()
        model(x).sum().backward()
        theirs.step()
    ours = info.optim_cls(model.parameters())
    ours.load_state_dict(theirs.state_dict())
    assert [(g["name"], g["step"], g["lr"], g["betas"]) for g in ours.param_groups] == \
        [("adamw", 2, 1e-3, (0.9, 0.999))]
    for p in model.parameters():
        assert torch.equal(ours.state[p]["exp_avg"], theirs.state[p]["exp_avg"])
        assert torch.equal(ours.state[p]["exp_avg_sq"], theirs.state[p]["exp_avg_sq"])


@pytest.mark.parametrize("named0", [True, False])
@pytest.mark.parametrize("named1", [True, False])
def test_can_load_from_to_named_state_dict(info, named0, named1):
    for kwargs in kwargs_of(info):
        model, x = _conv_model()
        opt = info.optim_cls(model.named_parameters() if named0 else model.parameters(), **kwargs)
        for _ in range(3):
            _model_step(opt, model, x)
        saved = copy.deepcopy(opt.state_dict())
        opt2 = info.optim_cls(model.named_parameters() if named1 else model.parameters(), **kwargs)
        opt2.load_state_dict(saved)
        _model_step(opt2, model, x)
        if named0 or named1:  # the names kept where either side had them, as torch keeps them
            assert opt2.state_dict()["param_groups"][0]["param_names"] == [n for n, _ in model.named_parameters()]
        else:
            assert all("param_names" not in g for g in opt2.state_dict()["param_groups"])
        if named0 and named1:  # names that differ by a wrapper's prefix (DDP's module.): the state dict's win
            wrapped = copy.deepcopy(saved)
            for g in wrapped["param_groups"]:
                g["param_names"] = ["module." + n for n in g["param_names"]]
            opt3 = info.optim_cls(model.named_parameters(), **kwargs)
            opt3.load_state_dict(wrapped)
            assert opt3.param_groups[0]["param_names"] == ["module." + n for n, _ in model.named_parameters()]


class _Tiny(torch.nn.Module):
    """An embedding, a hidden matrix and a head: routed by their modules, or (bare tensors) by shape alone."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(50, 8)
        self.mlp = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 50, bias=False)

    def forward(self, idx):
        return self.head(torch.relu(self.mlp(self.wte(idx))))


def test_routing_difference_is_named(info):
    """A model's optimizer and one of its bare tensors route apart (the embedding and head: AdamW by their modules,
    NorMuon by shape alone): a state dict of one does not load into the other, and the refusal says why and how to
    build them alike. Names that differ on both sides are refused too; nothing changes either way."""
    model = _Tiny()
    by_model = info.optim_cls(model)
    bare = info.optim_cls(model.parameters())
    before = copy.deepcopy(bare.state_dict())
    with pytest.raises(ValueError, match=r"routed by their shapes alone.*pass model=model beside model.parameters"):
        bare.load_state_dict(by_model.state_dict())
    with pytest.raises(ValueError, match="routed by their shapes alone"):
        by_model.load_state_dict(before)
    assert_same(bare.state_dict(), before)
    told = info.optim_cls(model.parameters(), model=model)  # bare tensors with the model beside: routed alike
    told.load_state_dict(by_model.state_dict())
    other = copy.deepcopy(by_model.state_dict())
    other["param_groups"][0]["param_names"][0] = "renamed.weight"
    with pytest.raises(ValueError, match=r"parameter names differ \('renamed.weight' saved vs 'mlp.weight' here\)"):
        by_model.load_state_dict(other)


@pytest.mark.parametrize("named", [True, False])
def test_save_load_equality_with_weights_only(info, named):
    for kwargs in kwargs_of(info):
        weight, bias, x = Parameter(torch.randn(2, 3)), Parameter(torch.randn(2)), torch.randn(3)
        opt = info.optim_cls(_named([weight, bias], named), **kwargs)
        for _ in range(3):
            _step(opt, weight, bias, x)
        saved = opt.state_dict()
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        assert_same(loaded, saved)


def test_load_nontensor_step(info):
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for p in params:
        p.grad = torch.rand_like(p)
    for kwargs in kwargs_of(info):
        opt = info.optim_cls(params, **kwargs)
        for _ in range(3):
            opt.step()
        state_dict = copy.deepcopy(opt.state_dict())
        for s in state_dict["state"].values():
            s["step"] = s["step"].item()
        opt.load_state_dict(state_dict)
        opt.step()
        assert [int(s["step"]) for s in opt.state_dict()["state"].values()] == [4, 4]


def test_state_dict_hooks(info):
    """Keys of opt.state that are no parameters are kept in state dicts (torch's hook tests put one there), through
    a load and a rebuild too."""
    def pre(opt):
        opt.state["test"] = 1

    def post(opt, state_dict):
        state_dict["ran_pre_hook"] = state_dict["state"].pop("test", None) == 1
        return state_dict

    param = Parameter(torch.rand(2, 3))
    opt = info.optim_cls([param])
    opt.register_state_dict_pre_hook(pre)
    assert opt.state_dict()["state"]["test"] == 1
    opt.register_state_dict_post_hook(post)
    state_dict = opt.state_dict()
    assert state_dict["ran_pre_hook"] and "test" not in state_dict["state"]
    other = info.optim_cls([Parameter(torch.rand(2, 3))])
    other.state["note"] = "kept"
    other.add_param_group({"params": [Parameter(torch.rand(4))]})  # a rebuild keeps it
    assert other.state["note"] == "kept" and other.state_dict()["state"]["note"] == "kept"
    with_key = info.optim_cls([Parameter(torch.rand(2, 3))])
    with_key.state["saved"] = 7
    fresh = info.optim_cls([Parameter(torch.rand(2, 3))])
    fresh.state["note"] = "gone after a load"
    state_dict = with_key.state_dict()
    state_dict["extra"] = True  # another top-level key: ignored, as torch ignores it
    fresh.load_state_dict(state_dict)
    assert fresh.state["saved"] == 7 and "note" not in fresh.state  # torch's: opt.state is the state dict's


def test_load_state_dict_hooks(info):
    def pre1(opt, state_dict):
        state_dict["param_groups"][0]["lr"] = 0.002

    def pre2(opt, state_dict):
        mine = copy.deepcopy(state_dict)
        mine["param_groups"][0]["lr"] = 0.003
        return mine

    def post(opt):
        opt.state["ran_post_hook"] = opt.param_groups[0]["lr"]

    param = Parameter(torch.rand(2, 3))
    opt = info.optim_cls([param])
    state_dict = opt.state_dict()
    opt.register_load_state_dict_pre_hook(pre1)
    opt.load_state_dict(state_dict)
    assert opt.param_groups[0]["lr"] == 0.002
    opt.register_load_state_dict_pre_hook(pre2, prepend=True)  # runs first: pre1 has the last word
    opt.register_load_state_dict_post_hook(post)
    opt.load_state_dict(state_dict)
    assert opt.param_groups[0]["lr"] == 0.002 and opt.state["ran_post_hook"] == 0.002


def test_step_hooks(info):
    data = []
    param = Parameter(torch.rand(2, 3))
    param.grad = torch.rand_like(param)
    opt = info.optim_cls([param])
    handles = [opt.register_step_pre_hook(lambda o, a, k: data.append("pre")),
               opt.register_step_post_hook(lambda o, a, k: data.append("post")),
               register_optimizer_step_pre_hook(lambda o, a, k: data.append("global pre")),
               register_optimizer_step_post_hook(lambda o, a, k: data.append("global post"))]
    try:
        opt.step()
    finally:
        for h in handles:
            h.remove()
    opt.step()
    assert data == ["global pre", "pre", "post", "global post"]


def test_deepcopy_and_pickle_are_refused(info):
    """Refused by design (docs/python.md): a copy would share or lose the native buffers bound to the model."""
    opt = info.optim_cls([Parameter(torch.randn(2, 3))])
    for copier in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be pickled or copied: its state lives in native buffers"):
            copier(opt)


# ------------------------------------------------------------------------------ param_groups edited by hand

def test_a_refused_add_param_group_changes_nothing(info):
    """A group torch's own add_param_group refuses (a tensor that is no leaf), after the planning took it: the
    optimizer is as it was and steps on."""
    weight, bias = Parameter(torch.randn(4, 3)), Parameter(torch.randn(4))
    opt = info.optim_cls([weight, bias])
    before = list(opt.param_groups)
    with pytest.raises(ValueError, match="can't optimize a non-leaf Tensor"):
        opt.add_param_group({"params": [torch.randn(5, requires_grad=True) * 2]})
    assert opt.param_groups == before and all(a is b for a, b in zip(opt.param_groups, before))
    weight.grad, bias.grad = torch.ones_like(weight), torch.ones_like(bias)
    opt.step()
    assert [g["step"] for g in opt.param_groups] == [1, 1]


def test_names_beside_a_model_and_empty_groups(info):
    """With model=, a tensor the model does not hold gets a generated name (no partial naming was asked for);
    an empty group is named as the others are."""
    model = torch.nn.Linear(4, 3)
    stray = Parameter(torch.randn(5))
    opt = info.optim_cls(list(model.parameters()) + [stray], model=model)
    assert [n for g in opt.param_groups for n in g["param_names"]] == ["weight", "bias", "param2"]
    bare = info.optim_cls([{"params": [model.weight]}, {"params": [], "algorithm": "adamw"}])
    assert all("param_names" not in g for g in bare.param_groups)
    named = info.optim_cls([{"params": [("w", model.weight)]}, {"params": [], "algorithm": "adamw"}])
    assert [g["param_names"] for g in named.param_groups] == [["w"], []]


def test_param_groups_edited_by_hand(info):
    """Appending to param_groups (torch supports it) plans the group as add_param_group would, at the next step: a
    torch-style group (no 'algorithm') is split by the routing rule. A repeated group is saved as torch saves it and
    refused at the step, naming add_param_group; a group removed or its parameters edited are refused. A refusal
    changes nothing."""
    model, extra = torch.nn.Linear(6, 4), torch.nn.Linear(4, 3)
    opt = info.optim_cls(list(model.parameters()), weight_decay=0.0)
    opt.param_groups.append({"params": list(extra.parameters()), "lr": 0.05})
    for p in list(model.parameters()) + list(extra.parameters()):
        p.grad = torch.ones_like(p)
    opt.load_state_dict(opt.state_dict())  # a state dict plans it as a step would: it loads back
    opt.step()
    assert [(g["name"], len(g["params"])) for g in opt.param_groups] == \
        [("normuon", 1), ("adamw", 1), ("group2_normuon", 1), ("group2_adamw", 1)]
    assert opt.param_groups[2]["lr"] == 0.05 and [g["step"] for g in opt.param_groups] == [1, 1, 1, 1]

    opt.param_groups.extend(opt.param_groups[:2])
    packed = opt.state_dict()["param_groups"]
    assert packed[4]["params"] == packed[0]["params"] and packed[5]["params"] == packed[1]["params"]
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"step\(\): param_groups\[4:\] were appended by hand and are planned as "
                                         r"add_param_group plans them: some parameters appear in more than one"):
        opt.step()
    assert len(opt.param_groups) == 6
    assert_same(opt.state_dict(), before)
    del opt.param_groups[4:]
    opt.step()

    removed = opt.param_groups.pop()
    with pytest.raises(ValueError, match="param_groups was edited by hand .* only appending groups is supported"):
        opt.step()
    opt.param_groups.append(removed)
    stray = Parameter(torch.randn(2, 2))
    opt.param_groups[0]["params"].append(stray)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\] was edited by hand; add parameters with "
                                         "add_param_group"):
        opt.step()
    opt.param_groups[0]["params"].pop()
    opt.step()
    assert [g["step"] for g in opt.param_groups] == [3, 3, 3, 3]

    named = info.optim_cls(model)  # torch's rule for a group added: named like the others
    named.param_groups.append({"params": list(extra.parameters())})
    with pytest.raises(ValueError, match="all optimizer param groups should be with/without names. cannot add param "
                                         "group without names"):
        named.step()


# ------------------------------------------------------------------------- parameters that are not contiguous

def _twin_steps(make, backend_kwargs, steps=4, seed=0):
    """Two optimizers over equal parameters, one laid out as given and one contiguous, stepped with the same
    gradients (each laid out as its parameter, and for the strided one also otherwise every other step)."""
    g = torch.Generator().manual_seed(seed)
    strided, contiguous = make()
    strides = [p.stride() for _, p in strided]
    opt_s = normuon.NorMuonAdamW(strided, **backend_kwargs)
    opt_c = normuon.NorMuonAdamW(contiguous, **backend_kwargs)
    for step in range(steps):
        for (_, ps), (_, pc) in zip(strided, contiguous):
            grad = torch.randn(pc.shape, generator=g).to(pc.dtype)
            pc.grad = grad.clone()
            ps.grad = torch.empty_like(ps).copy_(grad) if step % 2 == 0 else grad.clone()
        opt_s.step()
        opt_c.step()
    assert [p.stride() for _, p in strided] == strides  # stepped where they lie: never replaced
    return strided, contiguous, opt_s, opt_c


def _pairs(tensors, dtype):
    """(name, strided) and (name, the contiguous twin) lists, in `dtype`."""
    laid = [(n, torch.empty_like(t, dtype=dtype).copy_(t)) for n, t in tensors]  # (empty_like keeps the layout)
    return [(n, Parameter(t)) for n, t in laid], [(n, Parameter(t.contiguous())) for n, t in laid]


def strided_cases(dtype=torch.float32):
    torch.manual_seed(3)
    _pairs_of = functools.partial(_pairs, dtype=dtype)
    return {
        # torch's non-contiguous case: every other element of a larger tensor
        "every other element": lambda: _pairs_of([("w", torch.randn(10, 5, 2)[..., 0]),
                                                  ("b", torch.randn(10, 2)[..., 0])]),
        # a dense permuted tensor, stepped where it lies
        "channels_last": lambda: _pairs_of([("conv.weight", torch.randn(4, 3, 3, 3).contiguous(
            memory_format=torch.channels_last)), ("norm.weight", torch.randn(4))]),
        # a matrix that is a transposed view: the transposed matrix it is in memory
        "transposed view": lambda: _pairs_of([("fc.weight", torch.randn(6, 8).t()),
                                              ("emb.weight", torch.randn(7, 5).t())]),
        # a bank of experts that is not contiguous: stepped through a contiguous copy
        "expert bank": lambda: _pairs_of([("moe.experts.w", torch.randn(3, 6, 4).transpose(1, 2))]),
    }


def _dense(t):
    """Its elements fill the span they lie in (these views are of fresh tensors: none lies twice)."""
    return t.numel() == 0 or 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) == t.numel()


def backends():
    yield "fast", dict(backend="fast")
    yield "reference", dict(backend="reference")
    yield "cuda-emulated", dict(_device_backend=emulated_cuda_backend())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(strided_cases()))
def test_strided_parameters_step_as_contiguous_twins(case, dtype):
    """Bit for bit as the same values laid out contiguously, on every backend, fp32 and bf16 (masters): parameters,
    state (views laid out as their parameter, as torch's optimizers keep theirs), state dicts. Dense tensors are
    stepped where they lie (no copy); any other is stepped through a contiguous copy, which memory_report counts."""
    require_native()
    for name, kwargs in backends():
        roles = {"moe.experts.w": "experts"} if case == "expert bank" else None
        strided, contiguous, opt_s, opt_c = _twin_steps(strided_cases(dtype)[case], dict(kwargs, roles=roles))
        for (n, ps), (_, pc) in zip(strided, contiguous):
            assert torch.equal(ps, pc), (name, n)
            for key, value in opt_c.state[pc].items():
                assert torch.equal(opt_s.state[ps][key], value), (name, n, key)
                if value.shape == pc.shape and _dense(ps) and case != "expert bank":  # (a bank: through a copy)
                    assert opt_s.state[ps][key].stride() == ps.stride(), (name, n, key)
        assert_same(opt_s.state_dict()["state"], opt_c.state_dict()["state"])
        dense = all(_dense(p) for _, p in strided) and case != "expert bank"
        extra = opt_s.memory_report()["workspace_bytes"] - opt_c.memory_report()["workspace_bytes"]
        assert extra == (0 if dense else sum(p.numel() * p.element_size() for _, p in strided)), (name, extra)


def test_nonfinite_names_the_callers_element():
    """A NaN/Inf gradient is named by its index in the parameter as the caller sees it (row-major over its
    shape), however the parameter or the gradient lies in memory, on every backend."""
    require_native()
    for name, kwargs in backends():
        params = {"conv.weight": Parameter(torch.randn(4, 3, 3, 3).contiguous(memory_format=torch.channels_last)),
                  "fc.weight": Parameter(torch.randn(6, 8).t()),
                  "w": Parameter(torch.randn(10, 5, 2)[..., 0])}
        opt = normuon.NorMuonAdamW(list(params.items()), verdict="sync", **kwargs)
        for target, p in params.items():
            where = (1, 2, 0, 1)[:p.dim()]
            for laid_as_param in (True, False):
                for q in params.values():
                    q.grad = None
                grad = torch.zeros(p.shape)
                grad[where] = float("nan")
                p.grad = torch.empty_like(p).copy_(grad) if laid_as_param else grad
                index = int(torch.tensor(where) @ torch.tensor(torch.zeros(p.shape).stride()))
                with pytest.raises(RuntimeError, match=rf"gradient of '{re.escape(target)}' holds nan at element "
                                                       rf"{index} \("):
                    opt.step()


def test_a_square_transposed_view_agrees_to_newton_schulz_rounding(info):
    """A square matrix that is a transposed view is stepped as the transposed matrix it is in memory: the same
    arithmetic with Newton-Schulz's products taken the other way round (fp32 Newton-Schulz: ulps apart)."""
    base = torch.randn(8, 8)
    view, twin = Parameter(base.t()), Parameter(base.t().contiguous())
    opts = [info.optim_cls([("m.weight", p)], ns_precision="fp32") for p in (view, twin)]
    for _ in range(3):
        grad = torch.randn(8, 8)
        view.grad, twin.grad = torch.empty_like(view).copy_(grad), grad.clone()
        for o in opts:
            o.step()
    assert view.stride() == (1, 8)
    torch.testing.assert_close(view, twin, rtol=0, atol=1e-6)


def test_writes_through_data_to_a_staged_fp32_parameter_are_seen(info):
    """An fp32 parameter is its own master: a write through .data (no version counter moves) is what the next
    step starts from, for one stepped through a contiguous copy as for a contiguous one."""
    weight = Parameter(torch.randn(4, 3, 2)[..., 0])
    twin = Parameter(weight.detach().clone())
    opts = [info.optim_cls([p]) for p in (weight, twin)]
    for step in range(3):
        for p, o in zip((weight, twin), opts):
            p.grad = torch.ones(p.shape)
            o.step()
            if step == 1:
                p.data.fill_(5.0)
    assert torch.equal(weight, twin) and weight.max() > 4


def test_strided_parameters_are_refused_under_sharding(info):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"parameters that are not contiguous \('m'\) are not served under "
                                             "sharded training"):
            info.optim_cls([("m", Parameter(torch.randn(6, 4).t()))], process_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def test_a_memory_format_changed_after_building_is_refused(info):
    model = torch.nn.Conv2d(3, 4, 3)
    opt = info.optim_cls(model)
    model.to(memory_format=torch.channels_last)
    model(torch.randn(1, 3, 5, 5)).sum().backward()
    with pytest.raises(RuntimeError, match="'weight' now lies in memory with strides .*build the optimizer after "
                                           r"model.to\(memory_format=...\)"):
        opt.step()


def test_strided_and_contiguous_runs_agree_after_outside_writes(info):
    """A strided parameter written from outside between steps (a load, an in-place op) is read again."""
    weight = Parameter(torch.randn(10, 5, 2)[..., 0])
    twin = Parameter(weight.detach().clone())
    opts = [info.optim_cls([p]) for p in (weight, twin)]
    for step in range(3):
        for p, o in zip((weight, twin), opts):
            p.grad = torch.full(p.shape, 0.1 * (step + 1))
            o.step()
            with torch.no_grad():
                p.mul_(0.5)
    assert torch.equal(weight, twin)

