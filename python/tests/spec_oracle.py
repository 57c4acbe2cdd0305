"""The oracle the Python tests hold the optimizers to: the spec's per-parameter steps (docs/spec.md) on CPU
fp32 tensors, one matrix at a time. The steps are reference/'s own arithmetic, bound in normuon._C
(spec_newton_schulz, spec_normuon_update, spec_adamw_update); the elementwise helpers below give the spec's
roundings to expectations a test writes out itself."""
import torch

from normuon.native import _C


def newton_schulz(update, h):
    """NS(update) of spec section 3.2 (fp32 result holding values of the group's working precision)."""
    update = update.float().contiguous()
    out = torch.empty_like(update)
    _C.spec_newton_schulz(update, out, h)
    return out


def normuon_update(p, g, M, v, h, per_row, transposed=False):
    """One NorMuon step (spec section 3.1) of one matrix, in place on p, M (momentum) and v (second moment)."""
    _C.spec_normuon_update(p, g.contiguous(), M, v, h, per_row, transposed)


def adamw_update(p, g, m, v, h, t):
    """One AdamW step (spec section 4, torch.optim.AdamW's single-tensor path) at the tensor's step t >= 1."""
    _C.spec_adamw_update(p, g.contiguous(), m, v, h, t)


def fp32(x):
    """A Python number rounded to fp32, as the spec rounds its scalars."""
    return float(torch.tensor(x, dtype=torch.float32))


def fma(x, y, z):
    """fp32 fma(x, y, z) with one rounding, elementwise, on any processor: x*y is exact in float64, and the
    float64 sum made round-to-odd (an inexact one gets an odd last bit) rounds to the correctly rounded fma."""
    x, y, z = (torch.as_tensor(t, dtype=torch.float64) if not torch.is_tensor(t) else t.double() for t in (x, y, z))
    p = x * y
    s = p + z
    bz = s - p  # TwoSum: the exact error of s = p + z
    e = (p - (s - bz)) + (z - bz)
    even = (s.view(torch.int64) & 1) == 0 if s.dim() else (s.reshape(1).view(torch.int64) & 1).reshape(()) == 0
    s = torch.where((e != 0) & even, torch.nextafter(s, s + e), s)
    return s.float()


def lerp(a, b, w):
    """torch's lerp with the spec's rounding (spec section 1): the weight decides which end anchors the fma."""
    w = fp32(w)
    d = b - a
    return fma(w, d, a) if abs(w) < 0.5 else fma(fp32(w - 1.0), d, b)
