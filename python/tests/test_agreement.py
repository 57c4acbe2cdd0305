"""Numbers: the AdamW part against torch.optim.AdamW, the fast backend against the reference (the spec's
per-parameter steps, reference/), and the optimizer against the spec applied per matrix (spec_oracle)."""
import math

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")

import normuon  # noqa: E402
from normuon import native  # noqa: E402
import spec_oracle as spec  # noqa: E402
from conftest import fill_grads, make_model, params_of  # noqa: E402
from conftest import require_exact_torch_sqrt, torch_addcmul_fuses, torch_sqrt_rounding_errors  # noqa: E402
from torch import nn  # noqa: E402

ADAM = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def adam_pair(betas):
    """The same AdamW-only parameters under NorMuonAdamW and torch.optim.AdamW(foreach=False)."""
    shapes = {"wte.weight": (300, 48), "ln.weight": (48,), "fc.bias": (1000,), "lm_head.weight": (200, 48),
              "scale": ()}
    torch.manual_seed(0)
    a = {n: nn.Parameter(torch.randn(s)) for n, s in shapes.items()}
    b = {n: nn.Parameter(p.detach().clone()) for n, p in a.items()}
    ours = normuon.NorMuonAdamW(a.items(), adamw_lr=ADAM["lr"], adamw_betas=betas, adamw_eps=ADAM["eps"],
                                adamw_weight_decay=ADAM["weight_decay"])
    assert all(r["algorithm"] == "adamw" for r in ours.routing_table())
    theirs = torch.optim.AdamW(b.values(), lr=ADAM["lr"], betas=betas, eps=ADAM["eps"],
                               weight_decay=ADAM["weight_decay"], foreach=False)
    return a, b, ours, theirs


def set_grads(a, b, step):
    g = torch.Generator().manual_seed(100 + step)
    for n in a:
        grad = torch.randn(a[n].shape, generator=g)
        a[n].grad, b[n].grad = grad.clone(), grad.clone()


def test_adamw_bitwise_with_torch_when_the_moment_forms_coincide(native):
    """With beta1 = 0 torch 1.13's m.mul_(beta1).add_(g, alpha=1-beta1) and the spec's lerp both give m = g
    exactly, so every other operation (decay, v, bias corrections, addcdiv) must match bit for bit."""
    require_exact_torch_sqrt()
    a, b, ours, theirs = adam_pair((0.0, 0.999))
    for step in range(1, 21):
        set_grads(a, b, step)
        ours.step()
        theirs.step()
        for n in a:
            assert torch.equal(a[n], b[n]), (n, step)
    state = ours.state_dict()["state"]
    for i, n in enumerate(a):
        if torch_addcmul_fuses():  # else torch's own v rounds twice (ATEN_CPU_CAPABILITY=default)
            assert torch.equal(state[i]["exp_avg_sq"], theirs.state[b[n]]["exp_avg_sq"]), n


def test_adamw_agrees_with_torch_within_fp32_tolerance(native):
    """torch 1.13 updates m with mul_ + add_, the spec (torch >= 2.0) with lerp_: m differs by rounding only,
    v stays bit-identical, and the parameters agree to a few fp32 ulps per step."""
    a, b, ours, theirs = adam_pair(ADAM["betas"])
    for step in range(1, 21):
        set_grads(a, b, step)
        ours.step()
        theirs.step()
        if step == 1 and torch_sqrt_rounding_errors() == 0:  # m = 0: both forms round (1-beta1)*g once
            assert all(torch.equal(a[n], b[n]) for n in a)
    state = ours.state_dict()["state"]
    for i, n in enumerate(a):
        torch.testing.assert_close(a[n], b[n], rtol=2e-6, atol=1e-7)
        if torch_addcmul_fuses():  # else torch's own v rounds twice (ATEN_CPU_CAPABILITY=default)
            assert torch.equal(state[i]["exp_avg_sq"], theirs.state[b[n]]["exp_avg_sq"]), n
        torch.testing.assert_close(state[i]["exp_avg"], theirs.state[b[n]]["exp_avg"], rtol=0, atol=1e-6)
    # Every parameter is AdamW's: one group, as torch.optim has it (the empty NorMuon half is left out).
    assert [(g["name"], g["step"]) for g in ours.param_groups] == [("adamw", 20)]


def run_model(backend, steps=4, dtype=None, skip_every=0, **kw):
    model = make_model(dtype=dtype)
    opt = normuon.NorMuonAdamW(model.named_parameters(), backend=backend, weight_decay=0.1,
                               adamw_weight_decay=0.05, **kw)
    names = [n for n, _ in model.named_parameters()]
    for step in range(1, steps + 1):
        skip = {n for i, n in enumerate(names) if skip_every and (i + step) % skip_every == 0}
        fill_grads(model, step, skip=skip)
        opt.step()
    return params_of(model), opt.state_dict()


def compare(a, b, exact=True, rtol=0.0, atol=0.0):
    (pa, sa), (pb, sb) = a, b
    for n in pa:
        if exact:
            assert torch.equal(pa[n], pb[n]), n
        else:
            torch.testing.assert_close(pa[n], pb[n], rtol=rtol, atol=atol, msg=lambda m: f"{n}: {m}")
    for i in sa["state"]:
        for k in sa["state"][i]:
            if exact:
                assert torch.equal(sa["state"][i][k], sb["state"][i][k]), (i, k)
            else:
                torch.testing.assert_close(sa["state"][i][k], sb["state"][i][k], rtol=rtol, atol=atol)


def compare_bf16_ns(a, b, start, update_bound=0.1, row_var_bound=0.05):
    """The fast backend against the reference with bf16 Newton-Schulz. Their GEMMs sum in different orders (the
    fast backend's oneDNN kernels, or fp32 GEMMs of the bf16 values where the processor has no bf16 dot
    product; the reference's spec GEMM), so single bf16 roundings of Newton-Schulz flip, as on any other platform. AdamW
    tensors, NorMuon momenta and the step counts stay bit for bit; NorMuon matrices and second moments are
    held to the comparator's bf16 bounds (docs/compare.md): the update's error relative to the distance it
    travelled, and row_var normwise."""
    (pa, sa), (pb, sb) = a, b
    names = {i: n for g in sa["param_groups"] for i, n in zip(g["params"], g["param_names"])}
    normuon_names = {names[i] for i, st in sa["state"].items() if "momentum_buffer" in st}

    def rel(x, y):
        x, y = x.double(), y.double()
        return ((x - y).norm() / y.norm()).item() if y.norm() > 0 else (x - y).norm().item()

    for n in pa:
        if n in normuon_names:
            assert rel(pa[n].float() - start[n].float(), pb[n].float() - start[n].float()) <= update_bound, n
        else:
            assert torch.equal(pa[n], pb[n]), n
    for i in sa["state"]:
        for k in sa["state"][i]:
            x, y = sa["state"][i][k], sb["state"][i][k]
            if k == "moment2_buffer":
                assert rel(x, y) <= row_var_bound, (names[i], k)
            elif not (k == "master_param" and names[i] in normuon_names):  # the parameter, checked above
                assert torch.equal(x, y), (names[i], k)


VARIANTS = [
    {},
    {"nesterov": False},
    {"reduce_axis": "longer_dim"},
    {"weight_decay_mode": "cautious"},
    {"eps_placement": "clamp", "lr_scale": "rms_matching"},
    {"ns_coefficients": "polar_express", "ns_eps": 1e-6, "lr_scale": "spectral"},
    {"ns_steps": 3, "beta2": 0.9},
]


@pytest.mark.parametrize("knobs", VARIANTS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "defaults")
def test_fast_matches_reference_in_bf16(knobs, native):
    """bf16 Newton-Schulz: every elementwise op rounds as torch's (AdamW and momenta bit for bit); the GEMMs
    sum in other orders, within the comparator's bounds."""
    compare_bf16_ns(run_model("fast", skip_every=5, **knobs), run_model("reference", skip_every=5, **knobs),
                    params_of(make_model()))


def test_fast_matches_reference_in_fp32_precision(native):
    """fp32 Newton-Schulz: the GEMMs differ (oneDNN sgemm in fast, the spec GEMM in the reference)
    in accumulation order only; measured max difference ~1e-8 absolute after 4 steps."""
    compare(run_model("fast", ns_precision="fp32"), run_model("reference", ns_precision="fp32"),
            exact=False, rtol=1e-5, atol=1e-7)


def test_bf16_parameters_fast_matches_reference(native):
    a, b = run_model("fast", dtype=torch.bfloat16), run_model("reference", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in a[0].values())
    compare_bf16_ns(a, b, params_of(make_model(dtype=torch.bfloat16)))
    assert all("master_param" in s for s in a[1]["state"].values())


def test_optimizer_equals_reference_functions_called_directly():
    """The optimizer's bookkeeping (views, groups, per-parameter step counts, missing gradients) around
    the reference backend equals the spec's steps applied per parameter to cloned fp32 tensors."""
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    plain = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = normuon.NorMuonAdamW(model.named_parameters(), backend="reference", weight_decay=0.1)
    algo = {r["name"]: r["algorithm"] for r in opt.routing_table()}
    nm = dict(native.defaults("normuon"), weight_decay=0.1)
    aw = dict(native.defaults("adamw"))
    state = {n: (torch.zeros_like(p), torch.zeros(p.shape[0]) if algo[n] == "normuon" else torch.zeros_like(p))
             for n, p in plain.items()}
    own = dict.fromkeys(names, 0)  # each parameter's own count, as torch's AdamW keeps it
    for step in range(1, 5):
        skip = {names[step]}  # one parameter without a gradient each step
        fill_grads(model, step, skip=skip)
        opt.step()
        for n in names:
            if n in skip:
                continue
            own[n] += 1
            g = dict(model.named_parameters())[n].grad.float()
            if algo[n] == "normuon":
                spec.normuon_update(plain[n], g, *state[n], nm, True)
            else:
                spec.adamw_update(plain[n], g, *state[n], aw, own[n])
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), plain[n]), n


def test_reference_invariants():
    """Spec section 3.4 on the reference's arithmetic: the update norm is lr*kappa*||O||_F; at step 1 every row of the
    normalised update has the same RMS (fp32 Newton-Schulz, no decay)."""
    torch.manual_seed(3)
    g = torch.randn(24, 40) * torch.logspace(-3, 3, 24, base=2.0).unsqueeze(1)
    h = dict(native.defaults("normuon"), ns_precision="fp32", lr=0.5)
    p = torch.zeros(24, 40)
    M, v = torch.zeros(24, 40), torch.zeros(24)
    spec.normuon_update(p, g, M, v, h, True)
    O = spec.newton_schulz(g.lerp(torch.lerp(torch.zeros(24, 40), g, 0.05), 0.95), h)
    update = -p / h["lr"]
    assert math.isclose(update.norm().item(), O.norm().item(), rel_tol=1e-5)
    row_rms = update.pow(2).mean(1).sqrt()
    torch.testing.assert_close(row_rms, row_rms.mean().expand(24), rtol=1e-4, atol=0)


def test_fast_matches_reference_on_small_and_odd_matrices(native):
    """Shapes whose Newton-Schulz GEMMs have at most 16^3 multiply-adds (where torch's own bf16 mm would
    accumulate in bf16), tall, wide, single-row and empty matrices: within the bf16 bounds."""
    shapes = {"a.weight": (8, 12), "b.weight": (12, 8), "c.weight": (16, 16), "d.weight": (48, 16),
              "e.weight": (16, 64), "f.weight": (1, 24), "g.weight": (24, 1), "h.weight": (0, 5),
              "i.weight": (256, 96)}

    def start():
        torch.manual_seed(0)
        return {n: torch.randn(s) * 0.05 for n, s in shapes.items()}

    def run(backend):
        params = {n: nn.Parameter(p) for n, p in start().items()}
        opt = normuon.NorMuonAdamW(params.items(), backend=backend, weight_decay=0.1)
        assert all(r["algorithm"] == "normuon" for r in opt.routing_table())
        g = torch.Generator().manual_seed(9)
        for _ in range(4):
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=g) * 3
            opt.step()
        return {n: p.detach().clone() for n, p in params.items()}, opt.state_dict()

    compare_bf16_ns(run("fast"), run("reference"), start())
