"""Gram Newton-Schulz in the reference (spec_oracle: reference/'s arithmetic, docs/spec.md section 3.2): the standard
iteration's polynomial evaluated on the Gram matrix, so in fp32 it agrees with the standard iteration to
rounding; square matrices take the standard iteration; every m x m product is exactly symmetric."""
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")

from normuon import native  # noqa: E402
import spec_oracle as spec  # noqa: E402


def hyper(**changes):
    return dict(native.defaults("normuon"), **changes)


def relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", [(96, 200), (200, 96), (70, 300)])
@pytest.mark.parametrize("coefficients", ["quintic", "polar_express"])
def test_gram_agrees_with_the_standard_iteration_in_fp32(shape, coefficients):
    torch.manual_seed(0)
    u = torch.randn(shape)
    standard = spec.newton_schulz(u, hyper(ns_precision="fp32", ns_coefficients=coefficients))
    gram = spec.newton_schulz(u, hyper(ns_precision="fp32", ns_coefficients=coefficients, ns_algorithm="gram"))
    assert gram.shape == u.shape
    assert relative(gram, standard) < 1e-3


def test_gram_in_bf16_stays_within_twice_the_standard_bf16_error():
    torch.manual_seed(1)
    u = torch.randn(128, 320)
    truth = spec.newton_schulz(u, hyper(ns_precision="fp32"))
    own = relative(spec.newton_schulz(u, hyper()), truth)
    gram = relative(spec.newton_schulz(u, hyper(ns_algorithm="gram")), truth)
    assert gram <= 2 * own, (gram, own)


def test_square_matrices_take_the_standard_iteration():
    torch.manual_seed(2)
    u = torch.randn(64, 64)
    assert torch.equal(spec.newton_schulz(u, hyper(ns_algorithm="gram")), spec.newton_schulz(u, hyper()))


@pytest.mark.parametrize("steps", [1, 2, 3, 7])
def test_every_schedule_length_runs_and_differs_from_standard_only_by_rounding(steps):
    torch.manual_seed(3)
    u = torch.randn(40, 100)
    h = hyper(ns_precision="fp32", ns_steps=steps)
    assert relative(spec.newton_schulz(u, dict(h, ns_algorithm="gram")), spec.newton_schulz(u, h)) < 1e-3


def test_the_optimizer_takes_gram_on_both_backends(native):
    """ns_algorithm is a NorMuon group knob: the fast CPU backend and the reference agree on it (bit for bit
    on these small matrices, where the fast backend's products are single panels), it changes the result,
    and a bad value is refused before anything changes."""
    import normuon
    from conftest import fill_grads, make_model, params_of

    def run(backend, **knobs):
        model = make_model()
        opt = normuon.NorMuonAdamW(model.named_parameters(), backend=backend, **knobs)
        for step in range(1, 4):
            fill_grads(model, step)
            opt.step()
        return params_of(model), opt

    fast, opt = run("fast", ns_algorithm="gram")
    ref, _ = run("reference", ns_algorithm="gram")
    standard, _ = run("fast")
    assert opt.param_groups[0]["ns_algorithm"] == "gram"
    assert all(torch.equal(fast[n], ref[n]) for n in fast)
    assert any(not torch.equal(fast[n], standard[n]) for n in fast)
    opt.param_groups[0]["ns_algorithm"] = "foo"
    with pytest.raises(ValueError, match=r"option 'normuon.ns_algorithm': unknown value 'foo' \(choose standard \| gram\)"):
        opt.step()
