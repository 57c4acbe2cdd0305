"""The spec (docs/spec.md) as plain per-parameter torch code: the Python twin of
reference/reference_backend.cpp, op for op, so that it rounds the way the C++ reference does.

All tensors are fp32. In bf16 Newton-Schulz mode every elementwise result is computed in fp32 from bf16
values and rounded to bf16 (torch's opmath on CUDA), and GEMMs multiply the bf16 values in fp32 (exact
products, fp32 sums, as the spec asks) and round the result: torch's own bf16 mm is not used, since it
accumulates in bf16 for small products in torch 1.13 and has no kernel at all below AVX-512 in oneDNN.
Reductions of the NorMuon statistics are accumulated in float64.
"""
import math

import torch

from .native import _C

QUINTIC = (3.4445, -4.7750, 2.0315)
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_SAFETY = 1.02

def ns_triple(h, k):
    if h["ns_coefficients"] == "quintic":
        return QUINTIC
    if h["ns_coefficients"] == "polar_express":
        return POLAR_EXPRESS[k]
    raise ValueError(f"unknown ns_coefficients {h['ns_coefficients']!r} (choose quintic | polar_express)")


def lr_scale_factor(rule, rows, cols):
    m, n = float(rows), float(cols)
    if rule == "official":
        return math.sqrt(max(1.0, m / n))
    if rule == "spectral":
        return math.sqrt(m / n)
    if rule == "rms_matching":
        return 0.2 * math.sqrt(max(m, n))
    raise ValueError(f"unknown lr_scale {rule!r} (choose official | spectral | rms_matching)")


def fp32(x):
    """A Python number rounded to fp32, as the spec rounds its scalars (and torch its scalar arguments)."""
    return float(torch.tensor(x, dtype=torch.float32))


def fma(x, y, z):
    """fp32 fma(x, y, z) with one rounding, elementwise (tensors or numbers), on any processor: torch has no
    fma, and whether its lerp_, addcmul_ and add_(alpha=) fuse depends on ATEN_CPU_CAPABILITY. x*y is exact
    in float64; the float64 sum is made round-to-odd (an inexact one gets an odd last bit, from its exact
    error), after which rounding to fp32 is the correctly rounded fma."""
    x, y, z = (torch.as_tensor(t, dtype=torch.float64) if not torch.is_tensor(t) else t.double() for t in (x, y, z))
    p = x * y
    s = p + z
    bz = s - p  # TwoSum: the exact error of s = p + z
    e = (p - (s - bz)) + (z - bz)
    even = (s.view(torch.int64) & 1) == 0 if s.dim() else (s.reshape(1).view(torch.int64) & 1).reshape(()) == 0
    inexact = (e != 0) & even
    s = torch.where(inexact, torch.nextafter(s, s + e), s)
    return s.float()


def lerp(a, b, w):
    """torch's lerp with the spec's rounding (spec section 1): the weight decides which end anchors the fma."""
    w = fp32(w)
    d = b - a
    return fma(w, d, a) if abs(w) < 0.5 else fma(fp32(w - 1.0), d, b)


def ieee_sqrt(x):
    """The spec's correctly rounded fp32 sqrt. torch 2.x takes sqrt on the CPU through a vectorised
    approximation (torch 2.11: 17% of fp32 results 1 ULP off); a faithful float64 sqrt rounded once to fp32
    is the correctly rounded one, so the CPU goes through float64. CUDA's sqrt is already IEEE's."""
    return x.double().sqrt().to(x.dtype) if x.device.type == "cpu" else x.sqrt()


def _norm_in_double(x):
    """Frobenius norm accumulated in float64, rounded once to fp32 (a 0-d tensor)."""
    return x.double().square().sum().sqrt().float()


def gram_restarts_before(k):
    """Gram Newton-Schulz restarts before iterations 2, 5, 8, ... (0-based; spec section 3.2)."""
    return k >= 2 and (k - 2) % 3 == 0


def gram_iteration(k, steps):
    """What iteration k of a Gram run does, (restart, fresh, update_r), as ns_gram_iteration in
    core/include/normuon/ns_algorithm.h: X = Q X and R = sym(X X^T) first; Q = P(Z + a I) (else Q (Z + a I));
    R = (Z + a I) R (Z + a I) for the next iteration."""
    restart = k > 0 and gram_restarts_before(k)
    return restart, k == 0 or restart, k + 1 < steps and not gram_restarts_before(k + 1)


def _gram_iteration(X, h, P, gemm):
    """Gram Newton-Schulz (spec section 3.2) on the normalised wide X (m < n): R = X X^T, Q collects the
    polynomial, X <- Q X only at a restart and at the end. Every m x m product keeps its lower triangle
    (one dot product per element, rounded once) and mirrors it, as a symmetric GEMM computes it."""
    m = X.size(0)
    lower = torch.ones(m, m, dtype=torch.bool, device=X.device).tril()

    def sym(c):
        return torch.where(lower, c, c.t())

    R, Q = sym(gemm(X, X.t())), None
    for k in range(h["ns_steps"]):
        restart, fresh, update_r = gram_iteration(k, h["ns_steps"])
        if restart:
            X = gemm(Q, X)
            R = sym(gemm(X, X.t()))
        a, b, c = ns_triple(h, k)
        Z = P(P(b * R) + sym(gemm(P(c * R), R)))
        if fresh:
            Q = Z.clone()
            Q.diagonal().add_(a)  # Z + a I: only the diagonal changes
            Q = P(Q)
        else:
            Q = P(P(a * Q) + sym(gemm(Q, Z)))
        if update_r:
            RZ = P(P(a * R) + sym(gemm(R, Z)))
            R = P(P(a * RZ) + sym(gemm(Z, RZ)))
    return gemm(Q, X)


def newton_schulz(update, h):
    """NS(U) of spec section 3.2 for a 2-D fp32 tensor; fp32 result holding values of the working precision.
    h: a group's values as the core checked them."""
    bf16 = h["ns_precision"] == "bf16"

    def P(x):
        return x.to(torch.bfloat16).to(torch.float32) if bf16 else x

    def gemm(x, y):  # x, y hold values of the working precision: bf16 products are exact in fp32
        return P(torch.mm(x, y))

    X = P(update.to(torch.float32, copy=True))
    tall = X.size(0) > X.size(1)
    if tall:
        X = X.t()  # iterate on the wide orientation: X X^T is the smaller Gram matrix
    norm = P(X.norm())
    if h["ns_coefficients"] == "quintic":
        denom = P(norm + h["ns_eps"])
    else:
        denom = P(P(norm * POLAR_EXPRESS_SAFETY) + h["ns_eps"])
    X = P(X / denom)
    if h["ns_algorithm"] == "gram" and X.size(0) != X.size(1):
        X = _gram_iteration(X, h, P, gemm)
    else:
        for k in range(h["ns_steps"]):
            a, b, c = ns_triple(h, k)
            A = gemm(X, X.t())
            B = P(P(b * A) + gemm(P(c * A), A))  # (c*A) @ A, as the official `c * A @ A`
            X = P(P(a * X) + gemm(B, X))
    if tall:
        X = X.t()
    return X


def normuon_update(p, g, M, v, h, per_row, transposed=False):
    """One NorMuon step (spec section 3.1) of one matrix, in place on p, M (momentum) and v (second moment).
    per_row: the statistics along the stored rows; transposed: p is stored [in, out], kappa follows [out, in]."""
    rows, cols = p.shape
    # 1-2. momentum (EMA) and the Nesterov blend; never hand M itself to Newton-Schulz.
    M.copy_(lerp(M, g, 1 - h["beta1"]))
    U = lerp(g, M, h["beta1"]) if h["nesterov"] else M.clone()
    # 3. orthogonalise, back to fp32.
    O = newton_schulz(U, h).contiguous()
    # 4. statistics along the neuron axis, accumulated in double.
    nu = _norm_in_double(O)
    r = O.double().square().mean(1 if per_row else 0).float()
    # 5-6. second moment (no bias correction: it cancels in the re-norm) and its inverse square root.
    v.copy_(lerp(v, r, 1 - h["beta2"]))
    if h["eps_placement"] == "add":
        s = ieee_sqrt(v).add_(h["denom_eps"]).reciprocal()
    elif h["eps_placement"] == "clamp":
        s = ieee_sqrt(v.clamp_min(h["denom_eps"])).reciprocal()
    else:
        raise ValueError(f"unknown eps_placement {h['eps_placement']!r} (choose add | clamp)")
    # 7-9. normalise, restore the Frobenius norm, apply the shape factor.
    update = O * (s.unsqueeze(1) if per_row else s.unsqueeze(0))
    nu_normalised = _norm_in_double(update)
    update.mul_(nu / (nu_normalised + h["renorm_eps"]))
    update.mul_(lr_scale_factor(h["lr_scale"], *((cols, rows) if transposed else (rows, cols))))
    # 10. weight decay.
    lr, wd, mode = h["lr"], h["weight_decay"], h["weight_decay_mode"]
    if mode == "decoupled":
        if wd != 0:
            p.mul_(1 - lr * wd)
    elif mode == "cautious":
        if wd != 0:
            mask = (update * p).ge(0).to(torch.float32)
            p.sub_(p * mask * (lr * wd))
    elif mode != "none":
        raise ValueError(f"unknown weight_decay_mode {mode!r} (choose decoupled | cautious | none)")
    # 11. the step: p.add_(update, alpha=-lr), one fma.
    p.copy_(fma(fp32(-lr), update, p))


def adamw_update(p, g, m, v, h, t):
    """One AdamW step (torch.optim.AdamW, single-tensor path; spec section 4) at group step t >= 1."""
    lr, wd = h["lr"], h["weight_decay"]
    if wd != 0:
        p.mul_(1 - lr * wd)
    m.copy_(lerp(m, g, 1 - h["beta1"]))
    v.copy_(fma(g * fp32(1 - h["beta2"]), g, v * fp32(h["beta2"])))  # v.mul_(beta2).addcmul_(g, g, 1 - beta2)
    bias_correction1 = 1 - math.pow(h["beta1"], t)
    bias_correction2 = 1 - math.pow(h["beta2"], t)
    step_size = lr / bias_correction1
    denom = (ieee_sqrt(v) / math.sqrt(bias_correction2)).add_(h["eps"])
    p.addcdiv_(m, denom, value=-step_size)


def begin_step(layout, entries, group_steps, entry_steps, nonfinite):
    """The shared step prologue (core/src/step_prologue.cpp), its rules asked of the core: a step with a
    NaN/Inf gradient is refused (RuntimeError under nonfinite='error') or skipped (its reason returned)
    before anything changes; else the counters advance (returned: group_steps, entry_steps).

    entries: in layout order, objects with .name, .group, .has_grad, .grad (fp32 tensor)."""
    for e in entries:
        if not e.has_grad:
            continue
        bad = (~torch.isfinite(e.grad)).reshape(-1).nonzero()
        if bad.numel():
            k = int(bad[0])
            return _C.nonfinite_gradient(e.name, float(e.grad.reshape(-1)[k]), k, group_steps[e.group] + 1, nonfinite)
    return _C.advance_steps(layout, [bool(e.has_grad) for e in entries], list(group_steps), list(entry_steps))


class ReferenceBackend:
    """Runs the per-parameter reference over the optimizer's entries, one parameter after another."""

    name = "reference-python"

    def step(self, layout, entries, hypers, group_steps, entry_steps, nonfinite):
        """entries: in layout order, objects with .name, .algorithm, .group, .has_grad, .param, .grad,
        .state (two fp32 tensors), .stats_per_row, .transposed; hypers: per group, a dict of the spec's field names.
        Returns (the skip reason, None, None), or (None, group_steps, entry_steps) advanced."""
        begun = begin_step(layout, entries, group_steps, entry_steps, nonfinite)
        if isinstance(begun, str):
            return begun, None, None
        group_steps, entry_steps = begun
        for i, e in enumerate(entries):
            if not e.has_grad or e.param.numel() == 0:
                continue  # untouched, state not advanced
            h = hypers[e.group]
            if e.algorithm == "normuon":
                normuon_update(e.param, e.grad, e.state[0], e.state[1], h, e.stats_per_row, e.transposed)
            else:
                adamw_update(e.param, e.grad, e.state[0], e.state[1], h, entry_steps[i])
        return None, group_steps, entry_steps
