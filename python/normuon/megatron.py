"""normuon.megatron: NorMuon for Megatron-LM through its emerging-optimizer registry (docs/python.md,
"Megatron-LM").

    import normuon.megatron
    normuon.megatron.register()          # once, before get_megatron_optimizer() / pretrain()
    config = OptimizerConfig(optimizer="normuon", muon_coefficient_type="simple", muon_split_qkv=False, ...)

`MegatronNorMuon` is a torch optimizer whose constructor takes the keyword names of Megatron's own
`TensorParallelAdaptiveMuon`, so Megatron's existing `muon_*` / `adaptive_muon_*` config fields reach it
without new flags. It runs this project's NorMuon (docs/spec.md section 3) on the fast backend over a flat
layout that it builds lazily and rebuilds whenever Megatron's wrappers change `param_groups` (fp32 copies
swapped in, groups narrowed or emptied). Its checkpoint state is parameter-shaped, as Megatron's
distributed checkpointing requires. Megatron is imported only inside `register()`.
"""
import importlib
import math
import re
from collections import defaultdict

import torch

from . import optim as _optim
from . import reference

# megatron-core releases whose emerging-optimizer registry this adapter was written against (major, minor),
# inclusive: 0.18 introduced the registry; the notes read 0.18, 0.19 and the 0.20 development snapshot.
KNOWN_GOOD_VERSIONS = ((0, 18), (0, 20))

# Megatron / Emerging-Optimizers value -> this project's option.
COEFFICIENT_TYPES = {"simple": "quintic"}  # EO "simple" is Keller's (3.4445, -4.7750, 2.0315) every iteration
MATMUL_PRECISIONS = {"medium": "bf16", "high": "fp32", "highest": "fp32"}
# scale_mode -> (lr_scale of the spec, c): Megatron's factor extra * S(m, n) equals (c * extra) * kappa(m, n).
SCALE_MODES = {
    "shape_scaling": ("official", 1.0),    # sqrt(max(1, m/n))
    "unit_rms_norm": ("spectral", 1.0),    # sqrt(m/n)
    "spectral": ("rms_matching", 1 / 0.2),  # sqrt(max(m, n)) = 0.2 * sqrt(max(m, n)) / 0.2
}
TP_MODES = ("duplicated", "blockwise", "distributed")

# Constructor keyword -> OptimizerConfig fields, first found wins (adaptive_muon_* > muon_* > plain).
# moment2_method is deliberately absent: choosing this optimizer is choosing NorMuon, and the config's
# adaptive_muon_moment2_method (default 'adamuon', no CLI flag) belongs to Megatron's adaptive_muon.
CONFIG_FIELDS = {
    "lr": ("lr",),
    "weight_decay": ("weight_decay",),
    "momentum": ("muon_momentum",),
    "nesterov": ("muon_nesterov",),
    "use_decoupled_weight_decay": ("muon_use_decoupled_weight_decay", "use_decoupled_weight_decay"),
    "split_qkv": ("muon_split_qkv",),
    "fp32_matmul_prec": ("muon_fp32_matmul_prec",),
    "coefficient_type": ("muon_coefficient_type",),
    "num_ns_steps": ("muon_num_ns_steps",),
    "scale_mode": ("muon_scale_mode",),
    "extra_scale_factor": ("muon_extra_scale_factor",),
    "tp_mode": ("muon_tp_mode",),
    "use_syrk": ("muon_use_syrk",),
    "beta2": ("adaptive_muon_beta2",),
    "eps": ("adaptive_muon_eps",),
}

_STATE_KEYS = ("momentum_buffer", "moment2_buffer")
_LOADABLE_KEYS = set(_STATE_KEYS) | {"master_param", "step"}


def _fail(message):
    raise ValueError(f"MegatronNorMuon: {message}")


def _group_size(group):
    """Ranks in a process group (None: 1); anything with size() works, so tests can pass stand-ins."""
    if group is None:
        return 1
    size = getattr(group, "size", None)
    if callable(size):
        return int(size())
    import torch.distributed as dist

    return int(dist.get_world_size(group))


def _number(where, group, key, high):
    """A group value as a float in [0, high]: a Python number or a one-element tensor (Megatron's scheduler
    may keep lr as a tensor and fill_() it)."""
    if key not in group:
        raise ValueError(f"MegatronNorMuon: {where} has no '{key}'")
    value = group[key]
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"MegatronNorMuon: {where}: {key} is a tensor of shape {tuple(value.shape)}, "
                             "not a scalar")
        value = value.item()
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"MegatronNorMuon: {where}: {key}={value!r} is not a number") from None
    if not math.isfinite(number) or not 0 <= number <= high:
        raise ValueError(f"MegatronNorMuon: {where}: {key}={value!r} is outside [0, {high:g}]")
    return number


class MegatronNorMuon(torch.optim.Optimizer):
    """NorMuon (docs/spec.md section 3) with the constructor of Megatron's TensorParallelAdaptiveMuon.

    The keyword arguments are Megatron's (see CONFIG_FIELDS for the config fields they come from); each
    maps onto the spec as docs/python.md ("Megatron-LM") tabulates. Values the adapter cannot run are
    rejected here, with the reason: moment2_method other than 'normuon', L2 weight decay, coefficient types
    other than 'simple', QKV splitting of a parameter that is QKV, and tensor parallelism (TP > 1).
    Accepted without effect: tp_mode (with TP = 1 every mode is the same), use_syrk (a CUDA kernel choice),
    qkv_split_shapes (no splitting).

    Per group, every step reads lr (a float or a one-element tensor), weight_decay, momentum, beta2 and
    eps, so Megatron's scheduler works. group['step'] is a Python int incremented once per step() in every
    group that has parameters, whether or not they have gradients (TE FusedAdam's rule, which Megatron's
    step synchronisation across optimizers relies on).

    Keyword-only extras: backend ('auto' | 'fast' | 'reference'; None reads NORMUON_BACKEND, then 'auto',
    which is the fast backend), threads (fast backend; 0 = one per processor), nonfinite ('error' |
    'skip_step').
    """

    def __init__(self, params, lr=3e-4, momentum=0.95, nesterov=True, weight_decay=0.01,
                 use_decoupled_weight_decay=True, split_qkv=False, is_qkv_fn=None, qkv_split_shapes=None,
                 fp32_matmul_prec="medium", coefficient_type="simple", num_ns_steps=5, scale_mode="spectral",
                 extra_scale_factor=1.0, pg_collection=None, tp_mode="duplicated", use_syrk=False,
                 moment2_method="normuon", beta2=0.95, eps=1e-8, *, backend=None, threads=0, nonfinite="error"):
        if moment2_method != "normuon":
            _fail(f"moment2_method={moment2_method!r}: this optimizer runs NorMuon only ('normuon'); use "
                  "Megatron's adaptive_muon for 'adamuon' or 'namo'")
        if use_decoupled_weight_decay not in (True,):
            _fail(f"use_decoupled_weight_decay={use_decoupled_weight_decay!r}: only decoupled weight decay "
                  "(p <- p * (1 - lr * wd)) is implemented, not L2 decay added to the gradient")
        if coefficient_type not in COEFFICIENT_TYPES:
            hint = {"quintic": "Emerging-Optimizers' 'quintic' is a schedule of five different triples",
                    "polar_express": "Emerging-Optimizers' 'polar_express' (eight triples) is not the 5-triple "
                                     "schedule normuon implements"}.get(coefficient_type, "unknown here")
            _fail(f"coefficient_type={coefficient_type!r} is not supported ({hint}); use 'simple' "
                  "(--muon-coefficient-type simple): Keller's quintic (3.4445, -4.7750, 2.0315) at every "
                  "iteration, the official NorMuon's orthogonaliser")
        if fp32_matmul_prec not in MATMUL_PRECISIONS:
            _fail(f"fp32_matmul_prec={fp32_matmul_prec!r}: choose {' | '.join(MATMUL_PRECISIONS)}")
        if isinstance(num_ns_steps, bool) or not isinstance(num_ns_steps, int) or not 1 <= num_ns_steps <= 100:
            _fail(f"num_ns_steps={num_ns_steps!r} is not an integer in [1, 100]")
        if scale_mode not in SCALE_MODES:
            _fail(f"scale_mode={scale_mode!r}: choose {' | '.join(SCALE_MODES)}")
        try:
            extra = float(extra_scale_factor)
        except (TypeError, ValueError):
            extra = float("nan")
        if not math.isfinite(extra) or extra <= 0:
            _fail(f"extra_scale_factor={extra_scale_factor!r} must be a finite number > 0")
        if tp_mode not in TP_MODES:
            _fail(f"tp_mode={tp_mode!r}: choose {' | '.join(TP_MODES)}")
        for attr in ("tp", "expt_tp"):
            size = _group_size(getattr(pg_collection, attr, None)) if pg_collection is not None else 1
            if size > 1:
                _fail(f"tensor parallelism is not supported yet (pg_collection.{attr} has {size} ranks): "
                      "NorMuon's statistics need the whole matrix. Run the NorMuon parameters with tensor "
                      "(and expert tensor) parallel size 1, or use Megatron's adaptive_muon")
        if nonfinite not in ("error", "skip_step"):
            _fail(f"nonfinite={nonfinite!r}: choose error | skip_step")
        if nesterov not in (True, False, 0, 1):
            _fail(f"nesterov={nesterov!r} is not a boolean")
        self.nonfinite = nonfinite
        self.split_qkv = bool(split_qkv)
        self.is_qkv_fn = is_qkv_fn if is_qkv_fn is not None else (lambda p: bool(getattr(p, "is_qkv", False)))
        self.qkv_split_shapes = qkv_split_shapes
        self.pg_collection = pg_collection
        self.tp_mode = tp_mode
        self.use_syrk = use_syrk
        self.coefficient_type = coefficient_type
        self.num_ns_steps = num_ns_steps
        self.scale_mode = scale_mode
        self.extra_scale_factor = extra
        self.fp32_matmul_prec = fp32_matmul_prec
        self.moment2_method = moment2_method
        self.nesterov = bool(nesterov)
        lr_scale, c = SCALE_MODES[scale_mode]
        # The spec has no free scale factor; an extra constant is folded into the learning rate and out of
        # the weight decay: p(1 - lr*wd) - lr*k*U  ==  p(1 - (k*lr)(wd/k)) - (k*lr)*U  (exact up to rounding).
        self._fold = c * extra
        self._fixed = dict(reference.NORMUON_DEFAULTS, nesterov=self.nesterov, ns_steps=num_ns_steps,
                           ns_coefficients=COEFFICIENT_TYPES[coefficient_type],
                           ns_precision=MATMUL_PRECISIONS[fp32_matmul_prec], reduce_axis="longer_dim",
                           lr_scale=lr_scale, weight_decay_mode="decoupled", eps_placement="clamp")
        self._choice = _optim._resolve_choice(backend)
        if _optim.native_error() is not None and self._choice != "reference":
            raise RuntimeError(f"MegatronNorMuon: backend '{self._choice}' needs the native module normuon._C, "
                               f"which could not be imported ({_optim.native_error()}); no fallback")
        self._threads = threads
        self._inner = None      # the NorMuonAdamW over the current parameters, built lazily
        self._signature = None  # what it was built for
        self._slots = {}        # id(param) -> (param, entry, momentum view, moment2 view)
        self._group_map = []    # (index in param_groups, index in the inner optimizer's groups)
        self.last_skip_reason = None
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, beta2=beta2, eps=eps)
        super().__init__(params, defaults)
        for i, g in enumerate(self.param_groups):
            for k, p in enumerate(g["params"]):
                self._check_param(p, f"param_groups[{i}]['params'][{k}]")

    # ------------------------------------------------------------------------------------- checks

    def _check_param(self, p, where):
        if p.dim() != 2:
            _fail(f"{where} has shape {list(p.shape)}: NorMuon needs whole 2-D matrices. Megatron routes "
                  "non-matrix parameters to Adam; under --use-distributed-optimizer the emerging-optimizer "
                  "path shards whole matrices per rank (LayerWise), never 1-D fragments")
        if p.device.type != "cpu":
            _fail(f"{where} is on {p.device}: normuon runs on CPU tensors only for now (its CUDA backend is "
                  "not written yet)")
        if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            _fail(f"{where} is {p.dtype}; float32, bfloat16 or float16 expected")
        if self.split_qkv and self.is_qkv_fn(p):
            _fail(f"{where} is a QKV weight and split_qkv is on: per-block (Q, K, V) Newton-Schulz is not "
                  "implemented; pass split_qkv=False (--muon-no-split-qkv) to orthogonalise it whole")

    def _hypers(self, i, group):
        """The spec's values for one group (docs/python.md tabulates the mapping); ValueError names it."""
        where = f"param_groups[{i}]"
        lr = _number(where, group, "lr", 1e6)
        weight_decay = _number(where, group, "weight_decay", 1e6)
        h = dict(self._fixed, lr=lr * self._fold, weight_decay=weight_decay / self._fold,
                 beta1=_number(where, group, "momentum", 1.0), beta2=_number(where, group, "beta2", 1.0),
                 denom_eps=_number(where, group, "eps", 1.0))
        if h["lr"] > 1e6:
            _fail(f"{where}: lr={lr!r} times the folded scale {self._fold:g} exceeds 1e6")
        return h

    # --------------------------------------------------------------------------- the flat layout

    def _current_signature(self):
        return tuple(tuple((id(p), p.dtype, tuple(p.shape), p.device) for p in g["params"])
                     for g in self.param_groups)

    def _ensure_built(self):
        """The layout matches param_groups, and self.state holds this optimizer's views (after a rebuild,
        or values someone else put into self.state, copied in)."""
        signature = self._current_signature()
        if signature != self._signature:
            self._rebuild(signature)
        else:
            self._adopt_state()

    def _rebuild(self, signature):
        """A new inner optimizer over the parameters param_groups holds now. State carries over from
        self.state (moved there by Megatron's wrappers or left from the previous layout); parameters that left
        the groups lose theirs."""
        present = []
        for i, g in enumerate(self.param_groups):
            params = list(g["params"])
            for k, p in enumerate(params):
                self._check_param(p, f"param_groups[{i}]['params'][{k}]")
            if params:
                present.append((i, params))
        inner, slots, group_map = None, {}, []
        if present:
            # The spec's defaults stand in for lr & co. until step() writes the groups' values (Megatron
            # builds with lr=None and lets its scheduler set it).
            groups = [dict(params=params, names=[f"g{i}.p{k}" for k in range(len(params))], name=f"g{i}",
                           algorithm="normuon", **self._fixed)
                      for i, params in present]
            try:
                inner = _optim.NorMuonAdamW(groups, backend=self._choice, threads=self._threads,
                                            nonfinite=self.nonfinite)
            except ValueError as error:
                raise ValueError(f"MegatronNorMuon: {error} (gI.pK is param_groups[I]['params'][K])") from None
            entries = {id(e.tensor): e for e in inner._entries}
            for j, (i, params) in enumerate(present):
                group_map.append((i, j))
                for p in params:
                    e = entries[id(p)]
                    m, n = e.shape
                    moment2 = e.state[1].view((m, 1) if e.stats_per_row else (1, n))  # EO's keepdim shape
                    slots[id(p)] = (p, e, e.state[0], moment2)
        # Carry the values over: check everything first, then write (old views stay valid until then).
        writes, where = [], self._positions()
        for p, e, momentum, moment2 in slots.values():
            old = self.state.get(p)
            if old:
                writes += self._state_writes(p, e, momentum, moment2, old, f"state of {where[id(p)]}")
            previous = self._slots.get(id(p))
            if previous is not None and previous[0] is p and e.low_precision and previous[1].low_precision:
                writes.append((e.param, previous[1].param))  # keep the fp32 master's low bits
        for dst, src in writes:
            dst.copy_(src)
        self._inner, self._slots, self._group_map, self._signature = inner, slots, group_map, signature
        self.state = defaultdict(dict)
        for p, _, momentum, moment2 in slots.values():
            self.state[p] = {"momentum_buffer": momentum, "moment2_buffer": moment2}

    def _adopt_state(self):
        """Someone replaced, removed or added entries of self.state (a load through torch's machinery,
        offload/restore, a wrapper moving state): copy their values into the flat state, reinstall the views."""
        stale = [p for p, e, momentum, moment2 in self._slots.values()
                 if not (self.state.get(p, {}).get("momentum_buffer") is momentum
                         and self.state.get(p, {}).get("moment2_buffer") is moment2)]
        if not stale and len(self.state) == len(self._slots):
            return
        writes, where = [], self._positions()
        for p in stale:
            _, e, momentum, moment2 = self._slots[id(p)]
            writes += self._state_writes(p, e, momentum, moment2, self.state.get(p) or {},
                                         f"state of {where.get(id(p), 'a parameter')}")
        for dst, src in writes:
            dst.copy_(src)
        state = defaultdict(dict)
        for p, _, momentum, moment2 in self._slots.values():
            state[p] = {"momentum_buffer": momentum, "moment2_buffer": moment2}
        self.state = state

    def _positions(self):
        """id(param) -> where it sits in param_groups, for messages."""
        return {id(p): f"param_groups[{i}]['params'][{k}]"
                for i, g in enumerate(self.param_groups) for k, p in enumerate(g["params"])}

    @staticmethod
    def _state_writes(p, e, momentum, moment2, saved, where):
        """(destination, source) pairs that put `saved` (a per-parameter state dict) into the flat state;
        empty means fresh state (zeros). ValueError, before anything is written, if it does not fit."""
        if not saved:
            return [(momentum, torch.zeros(())), (moment2, torch.zeros(()))]
        unknown = sorted(set(saved) - _LOADABLE_KEYS)
        missing = [k for k in _STATE_KEYS if k not in saved]
        if unknown or missing:
            raise ValueError(f"MegatronNorMuon: {where} has keys {sorted(saved)}; expected momentum_buffer and "
                             "moment2_buffer (optionally master_param, step)")
        shape = tuple(p.shape)
        m, n = shape
        writes = []
        for key in _STATE_KEYS + ("master_param",):
            src = saved.get(key)
            if src is None:
                continue
            if not isinstance(src, torch.Tensor) or not src.is_floating_point():
                got = src.dtype if isinstance(src, torch.Tensor) else type(src).__name__
                raise ValueError(f"MegatronNorMuon: {where}: {key} is {got}, not a floating-point tensor")
            got = tuple(src.shape)
            if key == "moment2_buffer":
                src = _reduce_moment2(src, shape, e.stats_per_row, where)
                writes.append((moment2, src.reshape(moment2.shape)))
                continue
            if got != shape:
                raise ValueError(f"MegatronNorMuon: {where}: {key} has shape {got}, expected {shape}")
            if key == "momentum_buffer":
                writes.append((momentum, src))
            elif e.low_precision:  # master_param: the fp32 master of a bf16/f16 parameter
                writes.append((e.param, src))
        return writes

    # ------------------------------------------------------------------------------- Megatron hooks

    def _init_group(self, group, skip_non_grad_params=True):
        """Megatron's init_state_fn calls this for every group (skip_non_grad_params=False) before it loads
        a checkpoint. State lives in the flat layout, so every parameter of every group has it once the
        layout is built; the arguments only follow Emerging-Optimizers' signature."""
        self._ensure_built()

    # ------------------------------------------------------------------------------------- the step

    @torch.no_grad()
    def step(self, closure=None):
        """One NorMuon step over every parameter with a gradient (others are left as they are), then
        group['step'] += 1 in every group with parameters. Hyper-parameters are read (and checked) first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_built()
        hypers = [(j, self._hypers(i, self.param_groups[i])) for i, j in self._group_map]
        skipped = None
        if self._inner is not None:
            for j, h in hypers:
                self._inner.param_groups[j].update(h)
            self._inner.step()
            skipped = self._inner.last_skip_reason
        self.last_skip_reason = skipped
        if skipped is None:
            for g in self.param_groups:
                if len(g["params"]) > 0:
                    g["step"] = int(g.get("step", 0)) + 1
        return loss

    @property
    def backend(self):
        """'fast-cpu' or 'reference-python' once built; before that the choice ('auto' | 'fast' | 'reference')."""
        return self._inner.backend if self._inner is not None else self._choice

    # ------------------------------------------------------------------------------- state dicts

    def state_dict(self):
        """torch's structure. Per parameter: momentum_buffer, and moment2_buffer expanded to the
        parameter's shape (Megatron's distributed checkpoint requires parameter-shaped state; both are fresh
        fp32 copies), plus master_param for a bf16/f16 parameter. No per-parameter step: group['step'] is the
        counter. Before the first step (nothing built, no state) "state" is empty, as torch's."""
        if self._inner is not None or any(self.state.values()):
            self._ensure_built()
        groups, state, index = [], {}, 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(index, index + len(g["params"])))
            for p in g["params"]:
                slot = self._slots.get(id(p))
                if slot is not None:
                    _, e, momentum, moment2 = slot
                    s = {"momentum_buffer": momentum.clone(),
                         "moment2_buffer": moment2.expand(e.shape).clone(memory_format=torch.contiguous_format)}
                    if e.low_precision:
                        s["master_param"] = e.param.clone()
                    state[index] = s
                index += 1
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Loads a state dict of the same groups and parameter counts. moment2_buffer may be
        parameter-shaped (this adapter's state_dict), reduced (length rows or cols) or Emerging-Optimizers'
        [m, 1] / [1, n]. A group without 'step' takes a per-parameter 'step' if all agree. Everything is
        checked before anything is written; a parameter without saved state gets fresh (zero) state."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            _fail("not an optimizer state dict: expected the keys 'state' and 'param_groups'")
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            _fail(f"the state dict has {len(saved_groups)} param groups, this optimizer {len(self.param_groups)}")
        self._ensure_built()
        writes, new_groups = [], []
        for i, (sg, g) in enumerate(zip(saved_groups, self.param_groups)):
            if len(sg["params"]) != len(g["params"]):
                _fail(f"param_groups[{i}]: {len(sg['params'])} parameters saved, {len(g['params'])} here")
            new = {k: v for k, v in sg.items() if k != "params"}
            for k in self.defaults:
                new.setdefault(k, g[k])
            new["params"] = g["params"]
            self._hypers(i, new)
            per_param_steps = set()
            for index, p in zip(sg["params"], g["params"]):
                saved = saved_state.get(index) or {}
                _, e, momentum, moment2 = self._slots[id(p)]
                where = f"state {index} (param_groups[{i}])"
                writes += self._state_writes(p, e, momentum, moment2, saved, where)
                if "step" in saved:
                    per_param_steps.add(_step_value(saved["step"], where))
            if "step" in new:
                new["step"] = _step_value(new["step"], f"param_groups[{i}]")
            elif len(per_param_steps) > 1:
                _fail(f"param_groups[{i}] has no 'step' and its parameters' steps differ: {sorted(per_param_steps)}")
            elif per_param_steps:
                new["step"] = per_param_steps.pop()
            new_groups.append(new)
        for dst, src in writes:
            dst.copy_(src)
        for g, new in zip(self.param_groups, new_groups):
            g.clear()
            g.update(new)


def _step_value(step, where):
    """A step counter (an int, or a one-element tensor as torch keeps per-parameter steps) as an int >= 0."""
    value = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    try:
        number = int(value)
        ok = not isinstance(value, bool) and number == value and number >= 0
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"MegatronNorMuon: {where}: step={step!r} is not a non-negative integer")
    return number


def _reduce_moment2(src, shape, per_row, where):
    """NorMuon's second moment as a 1-D tensor from any of its three forms."""
    m, n = shape
    length, keep = (m, (m, 1)) if per_row else (n, (1, n))
    got = tuple(src.shape)
    if got == (length,):
        return src
    if got == keep:
        return src.reshape(length)
    if got == (m, n):
        if src.numel() == 0:
            return src.new_zeros(length)
        reduced = src[:, 0] if per_row else src[0, :]
        full = reduced.unsqueeze(1) if per_row else reduced.unsqueeze(0)
        if not torch.equal(src, full.expand(m, n)):
            axis = "row" if per_row else "column"
            raise ValueError(f"MegatronNorMuon: {where}: the parameter-shaped moment2_buffer is not constant "
                             f"along each {axis} (statistics are per {axis} for a {m}x{n} matrix)")
        return reduced
    raise ValueError(f"MegatronNorMuon: {where}: moment2_buffer has shape {got}; expected {(length,)}, {keep} "
                     f"or the parameter's {(m, n)}")


# ------------------------------------------------------------------------------------- registration

def init_state_fn(opt, config=None):
    """Megatron's init_state_fn contract: state for every parameter, with or without a gradient."""
    for group in opt.param_groups:
        opt._init_group(group, skip_non_grad_params=False)


def config_to_kwargs(config, model_chunks=None, pg_collection=None, *, backend=None, threads=0):
    """MegatronNorMuon's keyword arguments from a Megatron OptimizerConfig (CONFIG_FIELDS)."""
    kwargs = {}
    for name, fields in CONFIG_FIELDS.items():
        for field in fields:
            if hasattr(config, field):
                kwargs[name] = getattr(config, field)
                break
    kwargs["is_qkv_fn"] = lambda p: bool(getattr(p, "is_qkv", False))
    kwargs["pg_collection"] = pg_collection
    kwargs["backend"] = backend
    kwargs["threads"] = threads
    return kwargs


def megatron_core_version():
    """The installed megatron-core version string, or None when it cannot be told."""
    for module_name in ("megatron.core.package_info", "megatron.core"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        version = getattr(module, "__version__", None)
        if isinstance(version, str) and version:
            return version
    try:
        from importlib import metadata

        return metadata.version("megatron-core")
    except Exception:  # noqa: BLE001 - not installed as a distribution, or no metadata
        return None


def _known_range():
    (a, b), (c, d) = KNOWN_GOOD_VERSIONS
    return f"{a}.{b} to {c}.{d}"


def check_version(version, allow_untested_version=False):
    """Fails closed (RuntimeError naming the version) outside KNOWN_GOOD_VERSIONS, or when the version
    cannot be told, unless allow_untested_version."""
    match = re.match(r"\s*(\d+)\.(\d+)", version or "")
    if match is None:
        if allow_untested_version:
            return
        raise RuntimeError(f"normuon.megatron.register: cannot tell the megatron-core version (found {version!r}); "
                           f"the adapter knows megatron-core {_known_range()}. Pass allow_untested_version=True "
                           "to register anyway")
    found = (int(match.group(1)), int(match.group(2)))
    low, high = KNOWN_GOOD_VERSIONS
    if not low <= found <= high and not allow_untested_version:
        why = (" (before 0.18 Megatron has no emerging-optimizer registry)" if found < low else
               " (newer than any release it was checked against)")
        raise RuntimeError(f"normuon.megatron.register: megatron-core {version} is outside the known-good range "
                           f"{_known_range()}{why}. Pass allow_untested_version=True to register anyway")


def register(name="normuon", *, replace_existing=False, allow_untested_version=False, backend=None, threads=0):
    """Adds MegatronNorMuon to Megatron's emerging-optimizer registry under `name`, so that
    OptimizerConfig(optimizer=name) (or --optimizer name, for a name argparse accepts) builds it.

    Touches only megatron.core.optimizer.emerging_optimizers._EMERGING_OPTIMIZERS[name] (a new
    EmergingOptimizerEntry) and, where it exists, megatron.core.optimizer.HAVE_EMERGING_OPTIMIZERS (set True,
    because the emerging path refuses to run without Emerging-Optimizers, which this optimizer does not
    need). Parameter routing (which parameters go to Adam) is copied from Megatron's own muon entry.

    Fails closed with RuntimeError when megatron-core is missing, of a version outside KNOWN_GOOD_VERSIONS
    (unless allow_untested_version) or without the registry. Replacing an entry Megatron already has
    (e.g. name='adaptive_muon', to keep the stock --optimizer choice) needs replace_existing=True.
    backend/threads are handed to every MegatronNorMuon it builds. Returns the entry."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"normuon.megatron.register: name={name!r} must be a non-empty string")
    try:
        mopt = importlib.import_module("megatron.core.optimizer")
        eo = importlib.import_module("megatron.core.optimizer.emerging_optimizers")
    except ImportError as error:
        raise RuntimeError(f"normuon.megatron.register: megatron-core is not importable ({error})") from None
    version = megatron_core_version()
    check_version(version, allow_untested_version)
    missing = [a for a in ("_EMERGING_OPTIMIZERS", "EmergingOptimizerEntry") if not hasattr(eo, a)]
    if missing or not isinstance(getattr(eo, "_EMERGING_OPTIMIZERS", None), dict):
        raise RuntimeError(f"normuon.megatron.register: megatron-core {version}: "
                           f"megatron.core.optimizer.emerging_optimizers lacks {', '.join(missing) or 'a dict registry'} "
                           "(the emerging-optimizer registry this adapter plugs into)")
    registry = eo._EMERGING_OPTIMIZERS
    existing = registry.get(name)
    if existing is not None and getattr(existing, "optimizer_cls", None) is not MegatronNorMuon and not replace_existing:
        cls = getattr(getattr(existing, "optimizer_cls", None), "__name__", type(existing).__name__)
        raise ValueError(f"normuon.megatron.register: '{name}' is already Megatron's {cls}; pass "
                         "replace_existing=True to take it over")
    template = registry.get("adaptive_muon") or registry.get("muon")

    def to_kwargs(config, model_chunks=None, pg_collection=None):
        return config_to_kwargs(config, model_chunks, pg_collection, backend=backend, threads=threads)

    fields = dict(optimizer_cls=MegatronNorMuon, init_state_fn=init_state_fn, config_to_kwargs=to_kwargs)
    if template is not None and hasattr(template, "default_param_overrides"):
        fields["default_param_overrides"] = template.default_param_overrides
    try:
        entry = eo.EmergingOptimizerEntry(**fields)
    except TypeError as error:  # the entry's fields were renamed: fail closed, touch nothing
        raise RuntimeError(f"normuon.megatron.register: megatron-core {version}: EmergingOptimizerEntry does not "
                           f"take {sorted(fields)} ({error})") from None
    registry[name] = entry
    if hasattr(mopt, "HAVE_EMERGING_OPTIMIZERS"):
        mopt.HAVE_EMERGING_OPTIMIZERS = True
    return entry


__all__ = ["MegatronNorMuon", "register", "init_state_fn", "config_to_kwargs", "check_version",
           "megatron_core_version", "KNOWN_GOOD_VERSIONS", "CONFIG_FIELDS"]
