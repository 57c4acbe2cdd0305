"""Step semantics around the user's tensors: schedulers editing param_groups, zero_grad, parameters
without gradients, NaN gradients, closures."""
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")

import normuon  # noqa: E402
from conftest import fill_grads, make_model, params_of  # noqa: E402


def test_lambda_lr_schedule_takes_effect(backend):
    """LambdaLR changes lr in every group each step; the run equals one where lr and weight_decay are set
    by hand to the same values, and differs from a constant-lr run."""
    factors = [1.0, 0.5, 0.25, 0.0, 2.0]

    def run(mode):
        model = make_model()
        opt = normuon.NorMuonAdamW(model.named_parameters(), backend=backend, weight_decay=0.1)
        schedule = lambda i: factors[min(i, len(factors) - 1)]  # noqa: E731
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if mode == "scheduler" else None
        for step in range(1, len(factors) + 1):
            if mode == "by_hand":
                for g, base in zip(opt.param_groups, (0.02, 3e-4)):
                    g["lr"] = base * factors[step - 1]
            fill_grads(model, step)
            opt.step()
            if sched:
                sched.step()
        return params_of(model), opt

    scheduled, opt = run("scheduler")
    by_hand, _ = run("by_hand")
    constant, _ = run("constant")
    assert all(torch.equal(scheduled[n], by_hand[n]) for n in scheduled)
    assert not torch.equal(scheduled["blocks.0.attn.weight"], constant["blocks.0.attn.weight"])
    assert not torch.equal(scheduled["wte.weight"], constant["wte.weight"])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02 * factors[-1])
    assert opt.param_groups[1]["lr"] == pytest.approx(3e-4 * factors[-1])


def test_zero_lr_and_weight_decay_edits(backend):
    model = make_model()
    opt = normuon.NorMuonAdamW(model.named_parameters(), backend=backend)
    fill_grads(model, 1)
    for g in opt.param_groups:
        g["lr"] = 0.0
    before = params_of(model)
    opt.step()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # lr 0, decay 0: no change
    assert [g["step"] for g in opt.param_groups] == [1, 1]
    # Fresh state and a zero gradient: the update is exactly 0 and only the edited decay acts (spec section 5).
    model = make_model()
    opt = normuon.NorMuonAdamW(model.named_parameters(), backend=backend)
    for g in opt.param_groups:
        g["lr"], g["weight_decay"] = 0.01, 0.5
    matrix, norm = model.blocks[0].attn.weight, model.ln_f.weight
    expected = [matrix.detach().mul(1 - 0.01 * 0.5), norm.detach().mul(1 - 0.01 * 0.5)]
    matrix.grad, norm.grad = torch.zeros_like(matrix), torch.zeros_like(norm)
    opt.step()
    assert torch.equal(matrix.detach(), expected[0]) and torch.equal(norm.detach(), expected[1])


def test_bad_hyper_parameter_edit_is_refused_before_anything_changes(backend):
    model = make_model()
    opt = normuon.NorMuonAdamW(model.named_parameters(), backend=backend)
    fill_grads(model, 1)
    before = params_of(model)
    opt.param_groups[1]["betas"] = (0.9, 1.5)
    with pytest.raises(ValueError, match=r"param_groups\[1\] \('adamw', adamw\): option 'adamw.beta2': 1.5 is outside \[0, 1\)"):
        opt.step()
    opt.param_groups[1]["betas"] = (0.9, 0.95)
    opt.param_groups[0]["reduce_axis"] = "longer_dim"
    with pytest.raises(ValueError, match="reduce_axis' was 'rows' when the optimizer was built"):
        opt.step()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert [g["step"] for g in opt.param_groups] == [0, 0]


def test_zero_grad_set_to_none_leaves_parameters_untouched(backend):
    model = make_model()
    opt = normuon.NorMuonAdamW(model.named_parameters(), backend=backend, weight_decay=0.1,
                               adamw_weight_decay=0.1)
    fill_grads(model, 1)
    opt.step()
    opt.zero_grad(set_to_none=True)
    before, state = params_of(model), opt.state_dict()
    opt.step()  # no gradient anywhere: nothing moves, no decay, steps don't advance
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert [g["step"] for g in opt.param_groups] == [1, 1]
    after = opt.state_dict()
    assert all(torch.equal(state["state"][i][k], after["state"][i][k]) for i in state["state"] for k in state["state"][i])


def test_parameters_without_gradients(backend):
    model = make_model()
    opt = normuon.NorMuonAdamW(model.named_parameters(), backend=backend, weight_decay=0.1)
    frozen = {"blocks.1.attn.weight", "wpe.weight"}
    for p in (model.blocks[1].attn.weight, model.wpe.weight):
        p.requires_grad_(False)
    before = params_of(model)
    for step in (1, 2):
        fill_grads(model, step, skip=frozen)
        opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(before[n], p) == (n in frozen), n
    state = opt.state_dict()
    index = {n: i for i, n in enumerate(opt.param_groups[0]["param_names"] + opt.param_groups[1]["param_names"])}
    assert not state["state"][index["blocks.1.attn.weight"]]["momentum_buffer"].any()
    assert not state["state"][index["wpe.weight"]]["exp_avg"].any()
    assert state["state"][index["wte.weight"]]["exp_avg"].any()


def test_nan_gradient_is_an_error_and_changes_nothing(backend):
    model = make_model()
    opt = normuon.NorMuonAdamW(model.named_parameters(), backend=backend)
    fill_grads(model, 1)
    opt.step()
    fill_grads(model, 2)
    model.blocks[0].mlp_fc.weight.grad[3, 5] = float("nan")
    before, state = params_of(model), opt.state_dict()
    with pytest.raises(RuntimeError, match=r"step 2: gradient of 'blocks.0.mlp_fc.weight' holds nan at element 101"):
        opt.step()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert [g["step"] for g in opt.param_groups] == [1, 1]
    after = opt.state_dict()
    assert all(torch.equal(state["state"][i][k], after["state"][i][k]) for i in state["state"] for k in state["state"][i])


def test_nonfinite_skip_step(backend):
    model = make_model()
    opt = normuon.NorMuonAdamW(model.named_parameters(), backend=backend, nonfinite="skip_step")
    fill_grads(model, 1)
    model.ln_f.bias.grad[0] = float("inf")
    before = params_of(model)
    opt.step()
    assert "gradient of 'ln_f.bias' holds inf at element 0; step skipped" in opt.last_skip_reason
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert [g["step"] for g in opt.param_groups] == [0, 0]
    fill_grads(model, 1)
    opt.step()
    assert opt.last_skip_reason is None and [g["step"] for g in opt.param_groups] == [1, 1]


def test_closure_and_training_reduces_the_loss(backend):
    model = make_model()
    opt = normuon.NorMuonAdamW(model.named_parameters(), backend=backend, lr=0.02, adamw_lr=3e-3)
    torch.manual_seed(1)
    idx = torch.randint(0, 64, (8, 16))

    def closure():
        opt.zero_grad(set_to_none=True)
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), idx[:, 1:].reshape(-1))
        loss.backward()
        return loss

    losses = [opt.step(closure).item() for _ in range(15)]
    assert losses[-1] < 0.8 * losses[0], losses


def test_user_modified_parameters_are_picked_up(backend):
    """An fp32 parameter is its own master: any edit between steps is seen, even through .data. A bf16 one
    is re-read when its version counter moved (an in-place write under no_grad, load_state_dict)."""
    for dtype in (torch.float32, torch.bfloat16):
        model = make_model(dtype=dtype)
        opt = normuon.NorMuonAdamW(model.named_parameters(), backend=backend, lr=0.0, adamw_lr=0.0)
        fill_grads(model, 1)
        opt.step()
        if dtype == torch.float32:
            model.ln_f.weight.data.fill_(3.0)
        else:
            with torch.no_grad():
                model.ln_f.weight.fill_(3.0)
        opt.step()  # lr 0: the step writes the master back, which must hold the edit
        assert torch.equal(model.ln_f.weight.detach(), torch.full_like(model.ln_f.weight, 3.0)), dtype


def test_a_model_reloaded_after_the_optimizer_keeps_the_masters_low_bits(backend):
    """Resume in either order: the model's load_state_dict moves the version counter, but a bf16 value that
    still rounds from the loaded master leaves the master as it is (bit-exact resume)."""
    model = make_model(dtype=torch.bfloat16)
    opt = normuon.NorMuonAdamW(model.named_parameters(), backend=backend)
    for s in (1, 2):
        fill_grads(model, s)
        opt.step()
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = opt.state_dict()
    fill_grads(model, 3)
    opt.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    twin = make_model(dtype=torch.bfloat16)
    twin_opt = normuon.NorMuonAdamW(twin.named_parameters(), backend=backend)
    twin_opt.load_state_dict(saved_opt)
    twin.load_state_dict(saved_model)  # after the optimizer: versions move, values round from the masters
    fill_grads(twin, 3)
    twin_opt.step()
    for k, v in twin.state_dict().items():
        assert torch.equal(v, expected[k]), k


@pytest.mark.parametrize("scheduler", ["OneCycleLR", "CyclicLR"])
def test_momentum_cycling_schedulers_work_with_their_defaults(scheduler, backend):
    # OneCycleLR and CyclicLR (cycle_momentum=True by default) refused the optimizer: they need "betas" or
    # "momentum" in its defaults. NorMuon groups now carry (beta1, beta2) as betas too, and the scheduler's
    # beta1 reaches the step.
    def make(optimizer):
        if scheduler == "OneCycleLR":
            return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.02, total_steps=10)
        return torch.optim.lr_scheduler.CyclicLR(optimizer, base_lr=0.001, max_lr=0.02, step_size_up=3)

    model = make_model()
    opt = normuon.NorMuonAdamW(model, backend=backend)
    try:  # torch 1.13's CyclicLR cycles only a "momentum" key: it refuses torch's own AdamW too
        make(torch.optim.AdamW(model.parameters()))
    except ValueError as error:
        with pytest.raises(ValueError, match=str(error).split(" with")[0]):
            make(opt)
        return
    sched = make(opt)
    seen = []
    for step in range(1, 6):
        fill_grads(model, step)
        opt.step()  # reads what the scheduler set last: both forms agree, and the options hold them
        nm, aw = opt.param_groups
        assert nm["betas"] == (nm["beta1"], nm["beta2"]) and nm["beta2"] == 0.95
        assert opt.engine.values[0]["beta1"] == nm["beta1"] and opt.engine.values[1]["beta1"] == aw["betas"][0]
        seen.append((nm["beta1"], aw["betas"][0]))
        sched.step()
    assert len({s[0] for s in seen}) > 1 and len({s[1] for s in seen}) > 1, seen  # beta1 moved in both


def test_betas_and_beta1_disagreeing_is_an_error(backend):
    model = make_model()
    opt = normuon.NorMuonAdamW(model, backend=backend)
    opt.param_groups[0]["beta1"] = 0.9  # the spec's name wins when only it moved
    fill_grads(model, 1)
    opt.step()
    assert opt.param_groups[0]["betas"] == (0.9, 0.95)
    opt.param_groups[0]["beta1"], opt.param_groups[0]["betas"] = 0.8, (0.7, 0.95)
    with pytest.raises(ValueError, match=r"betas=\(0.7, 0.95\) and beta1=0.8, beta2=0.95 disagree"):
        opt.step()
    with pytest.raises(ValueError, match="disagree"):
        normuon.NorMuonAdamW([{"params": list(model.named_parameters()), "betas": (0.9, 0.9), "beta1": 0.5}],
                             backend=backend)


def test_a_checkpoint_saved_after_a_scheduler_moved_betas_loads(backend):
    # state_dict saved the scheduler's betas beside the stale beta1, and loading it said they disagree.
    model = make_model()
    opt = normuon.NorMuonAdamW(model, backend=backend)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=10)
    fill_grads(model, 1)
    opt.step()
    sched.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["betas"] == (sd["param_groups"][0]["beta1"], sd["param_groups"][0]["beta2"])
    other = normuon.NorMuonAdamW(make_model(), backend=backend)
    other.load_state_dict(sd)
    assert other.param_groups[0]["beta1"] == sd["param_groups"][0]["beta1"] != 0.95


def test_betas_given_alone_in_a_normuon_group(backend):
    # {"betas": ...} in a NorMuon or auto group always raised "disagree" (the defaults filled beta1 first).
    model = make_model()
    opt = normuon.NorMuonAdamW([{"params": list(model.named_parameters()), "betas": (0.9, 0.99)}], backend=backend)
    nm = next(g for g in opt.param_groups if g["algorithm"] == "normuon")
    assert (nm["beta1"], nm["beta2"], nm["betas"]) == (0.9, 0.99, (0.9, 0.99))


def test_adamw_counts_steps_per_parameter_as_torch_does(backend):
    """A parameter that gets no gradient does not advance its own count (torch.optim.AdamW, the official
    NorMuon's per-parameter state): its bias corrections stay torch's. With one counter per group it drifted
    by about 6e-3 after six steps."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(32)) for _ in range(3)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = normuon.NorMuonAdamW(adamw_params=ours, adamw_lr=1e-2, adamw_betas=(0.9, 0.99), adamw_eps=1e-8,
                               adamw_weight_decay=0.1, backend=backend)
    ref = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for step in range(1, 7):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(32, generator=gen) for _ in ours]
        for k, (a, b) in enumerate(zip(ours, theirs)):
            missing = k == 0 and step in (1, 2, 4)  # the first parameter misses three steps
            a.grad = None if missing else grads[k].clone()
            b.grad = None if missing else grads[k].clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):  # torch's CPU sqrt is not always correctly rounded: last-bit differences
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)
    assert [float(s["step"]) for s in opt.state_dict()["state"].values()] == [3.0, 6.0, 6.0]
