"""torch's GradScaler with NorMuonAdamW: the scale and found_inf are handed to the step
(_step_supports_amp_scaling), which divides every gradient by the scale as it reads it (as torch's fused
AdamW does) and skips the step when the scaler found inf/NaN gradients, instead of a separate unscale pass."""
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")

import normuon  # noqa: E402
from normuon.optim import FOUND_INF_REASON  # noqa: E402
from conftest import fill_grads, make_model, params_of  # noqa: E402


def scaled(model, scale):
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(scale)  # what backward of (loss * scale) gives, exactly: the scale is a power of 2


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_the_step_unscales_as_it_reads_and_skips_on_found_inf(dtype, backend):
    plain, amp = make_model(dtype=dtype), make_model(dtype=dtype)
    opt_plain = normuon.NorMuonAdamW(plain, backend=backend, weight_decay=0.1, adamw_weight_decay=0.05)
    opt_amp = normuon.NorMuonAdamW(amp, backend=backend, weight_decay=0.1, adamw_weight_decay=0.05)
    assert opt_amp._step_supports_amp_scaling
    for step in range(1, 5):
        fill_grads(plain, step)
        fill_grads(amp, step)
        scale = torch.tensor(2.0 ** (10 + step))
        scaled(amp, scale)
        grads_before = {n: p.grad.clone() for n, p in amp.named_parameters()}
        opt_amp.grad_scale, opt_amp.found_inf = scale, torch.tensor(0.0)  # as GradScaler.step sets them
        opt_amp.step()
        del opt_amp.grad_scale, opt_amp.found_inf
        opt_plain.step()
        assert all(torch.equal(grads_before[n], p.grad) for n, p in amp.named_parameters())  # read, not changed
    want, got = params_of(plain), params_of(amp)
    assert all(torch.equal(want[n], got[n]) for n in want)
    # found_inf: the step changes nothing and says why, whatever nonfinite says.
    fill_grads(amp, 9)
    opt_amp.grad_scale, opt_amp.found_inf = torch.tensor(1024.0), torch.tensor(1.0)
    opt_amp.step()
    assert opt_amp.last_skip_reason == FOUND_INF_REASON
    assert all(torch.equal(got[n], p.detach()) for n, p in amp.named_parameters())
    assert [g["step"] for g in opt_amp.param_groups] == [4, 4]
    opt_amp.grad_scale, opt_amp.found_inf = torch.tensor(0.0), torch.tensor(0.0)
    with pytest.raises(ValueError, match="scale 0.0 is not finite and > 0"):
        opt_amp.step()


def test_with_torchs_cpu_grad_scaler(backend):
    amp_module = getattr(torch, "amp", None)
    if amp_module is None or not hasattr(amp_module, "GradScaler"):
        pytest.skip(f"torch {torch.__version__} has no torch.amp.GradScaler (CPU scaling came with torch 2.3)")
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
    except (TypeError, RuntimeError) as error:
        pytest.skip(f"no CPU GradScaler in torch {torch.__version__}: {error}")
    plain, amp = make_model(), make_model()
    opt_plain = normuon.NorMuonAdamW(plain, backend=backend)
    opt_amp = normuon.NorMuonAdamW(amp, backend=backend)
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    scales = []
    for step in range(1, 6):
        for model, opt in ((plain, opt_plain), (amp, opt_amp)):
            opt.zero_grad(set_to_none=True)
            loss = model(idx).float().square().mean()
            if model is amp:
                scaler.scale(loss).backward()
                if step == 3:
                    amp.blocks[0].attn.weight.grad[0, 0] = float("inf")  # the scaler skips, and backs off
                scaler.step(opt_amp)
                scaler.update()
                scales.append(scaler.get_scale())
            elif step != 3:
                loss.backward()
                opt_plain.step()
        if step == 3:
            assert opt_amp.last_skip_reason == FOUND_INF_REASON
    assert scales[2] == scales[1] / 2  # the inf step: the scaler backed off
    want, got = params_of(plain), params_of(amp)
    for n in want:  # the scaled backward differs from the plain one only by rounding of the loss scaling
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)
    assert [g["step"] for g in opt_amp.param_groups] == [g["step"] for g in opt_plain.param_groups] == [4, 4]


def test_after_unscale_only_found_inf_is_handed_over(backend):
    # scaler.unscale_(opt) (to clip) unscales the gradients and leaves grad_scale None: the step then took
    # that for a broken scaler and raised. Now it reads the gradients as they are and honours found_inf.
    plain, amp = make_model(), make_model()
    opt_plain = normuon.NorMuonAdamW(plain, backend=backend)
    opt_amp = normuon.NorMuonAdamW(amp, backend=backend)
    fill_grads(plain, 1)
    fill_grads(amp, 1)
    opt_amp.grad_scale, opt_amp.found_inf = None, torch.tensor(0.0)
    opt_amp.step()
    opt_plain.step()
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(plain.parameters(), amp.parameters()))
    opt_amp.found_inf = torch.tensor(1.0)
    opt_amp.step()
    assert opt_amp.last_skip_reason == FOUND_INF_REASON


class ScalerOf113:
    """torch 1.13's GradScaler protocol with _step_supports_amp_scaling: it calls step(grad_scaler=self),
    and the optimizer unscales through it (its unscale_ needs CUDA there, so this one divides on the CPU)."""

    def __init__(self, scale):
        self.scale = scale
        self._per_optimizer_states = {}

    def unscale_(self, opt):
        state = self._per_optimizer_states.setdefault(id(opt), {"found_inf_per_device": {}})
        found = 0.0
        for g in opt.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.grad.div_(self.scale)
                    found += float(not torch.isfinite(p.grad).all())
        state["found_inf_per_device"]["cpu"] = torch.tensor(found)

    def step(self, opt):
        self._per_optimizer_states[id(opt)] = {"found_inf_per_device": {}}
        return opt.step(grad_scaler=self)


def test_torch_113_grad_scaler_protocol(backend):
    # torch 1.13 passes itself as grad_scaler=; step() had no such argument: a TypeError on every CUDA
    # torch 1.13 install. Now the scaler's own unscale_ runs and its found_inf skips.
    plain, amp = make_model(), make_model()
    opt_plain = normuon.NorMuonAdamW(plain, backend=backend)
    opt_amp = normuon.NorMuonAdamW(amp, backend=backend)
    scaler = ScalerOf113(1024.0)
    for step in (1, 2):
        fill_grads(plain, step)
        fill_grads(amp, step)
        scaled(amp, 1024.0)
        scaler.step(opt_amp)
        opt_plain.step()
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(plain.parameters(), amp.parameters()))
    fill_grads(amp, 3)
    amp.blocks[0].attn.weight.grad[0, 0] = float("inf")
    scaler.step(opt_amp)
    assert opt_amp.last_skip_reason == FOUND_INF_REASON
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        opt_amp.step(closur=None)
