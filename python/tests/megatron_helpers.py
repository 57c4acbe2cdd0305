"""Pieces the Megatron adapter tests share (test_megatron_contract.py, test_megatron_adamw.py,
test_megatron_split.py): parameters, gradients, Megatron-shaped param groups, and what Megatron's
OptimizerParamScheduler writes between steps. Import it after pytest.importorskip("torch")."""
import torch


def random_params(shapes, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def set_grads(params, grads):
    for p, grad in zip(params, grads):
        p.grad = None if grad is None else grad.to(p.dtype)


def megatron_groups(params_a, params_b, empty_extra=None, **extra_b):
    """Param groups as Megatron's _get_param_groups builds them: extra keys, an empty group, wd_mult 0."""
    common = dict(is_expert_parallel=False, lr_mult=1.0, is_decoupled_lr=False, max_lr=1e-2, min_lr=1e-3)
    return [dict(params=list(params_a), default_config=True, wd_mult=1.0, **common),
            dict(params=[], default_config=False, wd_mult=1.0, **(empty_extra or {}), **common),
            dict(params=list(params_b), default_config=False, wd_mult=0.0, **extra_b, **common)]


def scheduler_step(opt, t, lr, wd, lr_tensor):
    """What OptimizerParamScheduler.step does before step t: lr as a float for steps 1 and 2, then as a
    tensor it fill_()s in place; weight_decay scaled by each group's wd_mult."""
    for g in opt.param_groups:
        if t >= 3:
            lr_tensor.fill_(lr)
            g["lr"] = lr_tensor
        else:
            g["lr"] = lr
        g["weight_decay"] = wd * g["wd_mult"]
