"""normuon.megatron: NorMuon (and the AdamW half) for Megatron-LM. docs/megatron.md tells how Megatron's
settings map onto the spec and what the adapter does with Megatron's wrappers.

    import normuon.megatron
    normuon.megatron.register()          # once, before get_megatron_optimizer() / pretrain()
    config = OptimizerConfig(optimizer="normuon", muon_coefficient_type="simple", ...)

Megatron is imported only inside register() and replace_adam().
"""
import copy
import functools
import importlib
import math
import re
import warnings
from collections.abc import MutableMapping

import torch

from . import native as _native
from .engine import Engine, resolve_modes
from .optim import NotCopyable
from .plan import DTYPES, plan_groups
from .row_blocks import split_rows

# megatron-core releases whose emerging-optimizer registry this adapter was written against (major, minor),
# inclusive: 0.18 introduced the registry; the notes read 0.18, 0.19 and the 0.20 development snapshot.
KNOWN_GOOD_VERSIONS = ((0, 18), (0, 20))

# Megatron / Emerging-Optimizers value -> this project's option.
COEFFICIENT_TYPES = {"simple": "quintic"}  # EO "simple" is Keller's (3.4445, -4.7750, 2.0315) every iteration
MATMUL_PRECISIONS = {"medium": "bf16", "high": "fp32", "highest": "fp32"}
# Megatron's --muon-fp32-matmul-prec also offers "low", which torch.set_float32_matmul_precision ignores (with
# a warning): Emerging-Optimizers' Newton-Schulz then runs at the process's float32 matmul precision.
FOLLOWS_TORCH = ("low",)
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

# Each algorithm's two state tensors, as Emerging-Optimizers and torch's AdamW name them.
_STATE_KEYS = {"normuon": ("momentum_buffer", "moment2_buffer"), "adamw": ("exp_avg", "exp_avg_sq")}


def _number(label, where, group, key):
    """group[key] as a float; its range is the core's to check (_checked)."""
    if key not in group:
        raise ValueError(f"{label}: {where} has no '{key}'")
    return _as_number(label, where, key, group[key])


def _as_number(label, where, key, value):
    """A Python number or a one-element tensor (Megatron's scheduler may keep lr as a tensor and fill_() it)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{label}: {where}: {key} is a tensor of shape {tuple(value.shape)}, not a scalar")
        value = value.item()
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{label}: {where}: {key}={value!r} is not a number") from None


def _checked(label, where, algorithm, values, given, notes=None):
    """The spec's values checked by the core; a refusal names the group value it came from. given: {spec
    field: (the group's key, its value)}; notes: {spec field: what to add to a refusal}."""
    try:
        return _native.check_values(where, algorithm, values)
    except _native.OptionError as error:
        field = error.key.rsplit(".", 1)[-1]
        if field not in given or not error.value:
            raise ValueError(f"{label}: {error}") from None
        key, value = given[field]
        raise ValueError(f"{label}: {where}: {key}={value!r}{(notes or {}).get(field, '')} {error.problem}") from None
    except ValueError as error:  # the group's values together (a Polar Express schedule too long), a missing value
        raise ValueError(f"{label}: {error}") from None


def _step_value(label, step, where):
    """A step counter (an int, or a one-element tensor as torch keeps per-parameter steps) as an int >= 0."""
    value = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    try:
        number = int(value)
        ok = not isinstance(value, bool) and number == value and number >= 0
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"{label}: {where}: step={step!r} is not a non-negative integer")
    return number


def ns_precision_for(fp32_matmul_prec):
    """The spec's ns_precision for Megatron's fp32_matmul_prec. "low" does what it does in Megatron with
    Emerging-Optimizers: torch ignores it, so the process's float32 matmul precision (read now) decides."""
    if fp32_matmul_prec in FOLLOWS_TORCH:
        current = torch.get_float32_matmul_precision()
        ns_precision = MATMUL_PRECISIONS.get(current, "fp32")
        warnings.warn(f"MegatronNorMuon: fp32_matmul_prec={fp32_matmul_prec!r} is not a torch precision (torch "
                      "ignores it, and so Megatron's own Muon runs at the process's float32 matmul precision, "
                      f"now {current!r}): Newton-Schulz runs in {ns_precision}. Choose 'medium' (bf16) or "
                      "'high' (fp32) to say which", stacklevel=3)
        return ns_precision
    return MATMUL_PRECISIONS[fp32_matmul_prec]


def _is_qkv(p):
    """Megatron tags its fused QKV weights with is_qkv."""
    return bool(getattr(p, "is_qkv", False))


class _Slot:
    """One parameter of param_groups and its engine entries: the parameter itself (blocks is None), or its
    blocks of rows (a split QKV weight: RowBlocks, stepped in place)."""

    __slots__ = ("param", "entries", "blocks", "views", "lazy")

    def __init__(self, param, entries, blocks):
        self.param, self.entries, self.blocks = param, entries, blocks
        self.views = _in_memory(entries[0]) if blocks is None else None  # self.state[param], live
        self.lazy = None  # the _SplitState installed in self.state for a split parameter


class _Tracked(dict):
    """self.state and its per-parameter dicts: any change made through their methods (by Megatron's wrappers
    or torch's machinery) sets a flag they share, so that a step tells in O(1) that nothing changed."""

    def __init__(self, changed, *args):
        super().__init__(*args)
        self.changed = changed  # [bool], shared by the mapping and its per-parameter dicts

    def __missing__(self, key):  # defaultdict(dict), as torch's optimizers have it
        self.changed[0] = True
        return dict.setdefault(self, key, _Tracked(self.changed))

    def __reduce__(self):  # copies and pickles as the plain dict it stands for
        return dict, (dict(self),)

    def _changes(name):
        def method(self, *args, **kwargs):
            self.changed[0] = True
            return getattr(dict, name)(self, *args, **kwargs)
        method.__name__ = name
        return method

    __setitem__, __delitem__, pop, popitem, clear, update, setdefault, __ior__ = map(
        _changes, ("__setitem__", "__delitem__", "pop", "popitem", "clear", "update", "setdefault", "__ior__"))
    del _changes


class _SplitState(MutableMapping):
    """self.state[p] of a split parameter: parameter-shaped copies of its blocks' state, assembled on first
    access (touched). Copies and pickles as a plain dict; `assemble` must not refer to the optimizer."""

    def __init__(self, assemble):
        self._assemble, self._data = assemble, None

    @property
    def touched(self):
        return self._data is not None

    def _values(self):
        if self._data is None:
            self._data = self._assemble()
        return self._data

    def _on_values(name):
        def method(self, *args):
            return getattr(self._values(), name)(*args)
        method.__name__ = name
        return method

    __getitem__, __setitem__, __delitem__, __iter__, __len__ = map(
        _on_values, ("__getitem__", "__setitem__", "__delitem__", "__iter__", "__len__"))
    del _on_values

    def __repr__(self):
        return f"_SplitState({self._values()!r})"

    def copy(self):
        return dict(self._values())

    __copy__ = copy

    def __deepcopy__(self, memo):
        return copy.deepcopy(self._values(), memo)

    def __reduce__(self):  # pickle, torch.save: the plain dict
        return dict, (self.copy(),)


def _in_memory(e):
    """An engine entry's state as live views, shaped like the entry but NorMuon's moment2_buffer, which is
    [m, 1] or [1, n] (its statistics axis), as Emerging-Optimizers has it."""
    views = dict(zip(_STATE_KEYS[e.algorithm], e.state))
    if e.algorithm == "normuon":
        m, n = e.shape
        views["moment2_buffer"] = e.state[1].view((m, 1) if e.stats_per_row else (1, n))
    return views


def _assemble(entries, blocks, master):
    """A parameter's state as fresh parameter-shaped fp32 copies (moment2_buffer expanded along its statistics
    axis; with master, master_param too for a bf16/f16 parameter): from its one entry, or from its blocks'."""
    parts = []
    for e in entries:
        part = {k: v.expand(e.shape).clone(memory_format=torch.contiguous_format) for k, v in _in_memory(e).items()}
        if master and e.low_precision:
            part["master_param"] = e.param.clone()
        parts.append(part)
    if blocks is None:
        return parts[0]
    out = {}
    for key in parts[0]:
        full = torch.empty(blocks[0].param_shape, dtype=torch.float32, device=parts[0][key].device)
        for part, block in zip(parts, blocks):
            block.write(full, part[key])
        out[key] = full
    return out


def _reduce_moment2(src, shape, per_row, where):
    """NorMuon's second moment as a 1-D tensor from any of its three forms."""
    m, n = shape
    length, keep = (m, (m, 1)) if per_row else (n, (1, n))
    got = tuple(src.shape)
    if got in ((length,), keep):
        return src.reshape(length)
    if got == (m, n):
        if src.numel() == 0:
            return src.new_zeros(length)
        reduced = src[:, 0] if per_row else src[0, :]
        if not torch.equal(src, reduced.reshape(keep).expand(m, n)):
            axis = "row" if per_row else "column"
            raise ValueError(f"MegatronNorMuon: {where}: the parameter-shaped moment2_buffer is not constant "
                             f"along each {axis} (statistics are per {axis} for a {m}x{n} matrix)")
        return reduced
    raise ValueError(f"MegatronNorMuon: {where}: moment2_buffer has shape {got}; expected {(length,)}, {keep} "
                     f"or the parameter's {(m, n)}")


class _MegatronFlat(NotCopyable, torch.optim.Optimizer):
    """What MegatronNorMuon and MegatronAdamW share: an engine (one algorithm) over the parameters param_groups
    holds now, built lazily and again when they change; self.state and state dicts translated to and from its
    buffers; TE FusedAdam's step rule. Subclasses set _label, _algorithm and implement _hypers."""

    _label = None
    _algorithm = None
    _fixed = None  # the spec's values the layout is built from (None: the spec's defaults)
    _per_param_step = False  # state_dict() adds each parameter's 'step' (torch's AdamW has one)

    def _setup(self, params, defaults, backend, threads, nonfinite, verdict, device_backend):
        """The common part of the constructors, last. device_backend: the tests' emulated CUDA engine."""
        _native.require(self._label)
        try:
            self._choice = resolve_modes(backend, nonfinite, verdict)
        except ValueError as error:
            self._fail(str(error))
        self.nonfinite = nonfinite
        self.verdict = verdict
        self._threads = threads
        self._device_backend = device_backend
        self.engine = None      # the engine over the current parameters, built lazily
        self._signature = None  # what it was built for
        self._slots = {}        # id(param) -> _Slot
        self._split_slots = []  # the slots of parameters split into row blocks
        self._stepped = []      # the param_groups with parameters (the engine's groups, in its order)
        self._advanced = []     # groups whose step the last step() advanced (taken back if it was skipped)
        self._settled_reason = None  # why the previous step was skipped, learnt when it was settled
        self.last_skip_reason = None
        super().__init__(params, defaults)
        self._check_all()

    def _fail(self, message):
        raise ValueError(f"{self._label}: {message}")

    def _params(self):
        """(parameter, where it sits in param_groups) for every parameter, in order."""
        for i, g in enumerate(self.param_groups):
            for k, p in enumerate(g["params"]):
                yield p, f"param_groups[{i}]['params'][{k}]"

    def _check_all(self):
        for p, where in self._params():
            self._check_param(p, where)

    def _check_param(self, p, where):
        """What any parameter must be (MegatronAdamW takes any shape: DistOpt hands over 1-D shards, some empty)."""
        if p.device.type not in ("cpu", "cuda"):
            self._fail(f"{where} is on {p.device}: normuon runs on CPU or CUDA tensors")
        if p.dtype not in DTYPES:
            self._fail(f"{where} is {p.dtype}; float32, bfloat16 or float16 expected")
        if p.is_sparse:
            self._fail(f"{where} is sparse")

    def _blocks(self, p, where):
        """None, or the RowBlocks that the engine steps as matrices of their own."""
        return None

    def _group_step(self, i):
        """param_groups[i]['step'] (0 when absent), checked."""
        return _step_value(self._label, self.param_groups[i].get("step", 0), f"param_groups[{i}]")

    # --------------------------------------------------------------------------- the flat layout

    def _ensure_built(self):
        """The layout matches param_groups, and self.state holds this optimizer's views (after a rebuild,
        or values someone else put into self.state, copied in)."""
        if self.engine is not None:
            self._settle()  # the previous step's deferred verdict, before its counters or state are read
        # Megatron swaps the tensor objects; a bound tensor changed in place is refused by the engine's step.
        signature = tuple(tuple(map(id, g["params"])) for g in self.param_groups)
        if signature != self._signature:
            self._rebuild(signature)
        else:
            self._adopt_state()

    def _rebuild(self, signature):
        """A new engine over the parameters param_groups holds now: state from self.state, fp32 masters and
        counters from the previous engine (Engine.carry_from); parameters that left the groups lose theirs."""
        self._check_all()
        stepped = [i for i, g in enumerate(self.param_groups) if len(g["params"])]
        groups, plan, all_blocks = [], [], {}
        for i in stepped:
            tensors, names = [], []
            for k, p in enumerate(self.param_groups[i]["params"]):
                blocks = self._blocks(p, f"param_groups[{i}]['params'][{k}]")
                # Each block is stepped where it lies in the parameter, as a matrix of its own.
                keys = [p] if blocks is None else [b.key for b in blocks]
                all_blocks.update((id(b.key), b) for b in blocks or ())
                plan.append((p, keys, blocks))
                tensors += keys
                names += [f"g{i}.p{k}"] if blocks is None else [f"g{i}.p{k}.b{j}" for j in range(len(blocks))]
            groups.append(dict(params=tensors, names=names, name=f"g{i}", algorithm=self._algorithm))
        engine, slots = None, {}
        if groups:
            # The spec's values stand in until step() hands over the groups' own (Megatron builds with
            # lr=None and lets its scheduler set it); the fixed ones (layout, plan) are final.
            values = _native.check_values("defaults", self._algorithm, self._fixed or _native.defaults(self._algorithm))
            aw = _native.defaults("adamw")
            try:  # the planned groups' values are not used: values are
                planned, entries = plan_groups(groups, _native.defaults("normuon"),
                                               dict(aw, betas=(aw["beta1"], aw["beta2"])), {}, {}, all_blocks)
                engine = Engine(entries, [(g["name"], self._algorithm, values) for g in planned], self._choice,
                                threads=self._threads, nonfinite=self.nonfinite, verdict=self.verdict,
                                device_backend=self._device_backend)
            except ValueError as error:
                raise ValueError(f"{self._label}: {error} (gI.pK is param_groups[I]['params'][K])") from None
            by_key = {id(e.tensor): e for e in engine.entries}
            for p, keys, blocks in plan:
                slots[id(p)] = _Slot(p, [by_key[id(t)] for t in keys], blocks)
        # The values: check everything first, then write (the previous views stay valid until then).
        writes = self._state_writes(slots.values())
        if engine is not None and self.engine is not None:
            # The fp32 masters with their low bits, and the counters (the state is written below).
            engine.carry_from(self.engine, [self._group_step(i) for i in stepped])
        for dst, src in writes:
            dst.copy_(src)
        self.engine, self._slots, self._stepped, self._signature = engine, slots, stepped, signature
        self._install_state()

    def _install_state(self, kept=None):
        """self.state from the engine's buffers: live views for parameters it steps whole, a _SplitState for
        split ones. kept: the state whose split parameters' mappings stay where they are, ours or someone's
        (a handle someone holds keeps counting until the next step refreshes them)."""
        changed = [False]
        self.state = _Tracked(changed)
        for slot in self._slots.values():
            if slot.blocks is None:
                value = _Tracked(changed, slot.views)
            else:
                value = None if kept is None else kept.get(slot.param)
                if value is None or (value is not slot.lazy and not len(value)):  # (len() would assemble ours)
                    value = self._split_state(slot)
            dict.__setitem__(self.state, slot.param, value)
        self._split_slots = [slot for slot in self._slots.values() if slot.blocks is not None]

    def _split_state(self, slot):
        # _assemble is a function: the partial holds no reference to this optimizer.
        slot.lazy = _SplitState(functools.partial(_assemble, slot.entries, slot.blocks, False))
        return slot.lazy

    def _refresh_split_state(self):
        """After a step: a split parameter's copies, if anyone looked at them or put others in their place,
        are stale now; a fresh, not yet assembled mapping takes their place."""
        for slot in self._split_slots:
            if not self._holds_ours(slot):
                dict.__setitem__(self.state, slot.param, self._split_state(slot))  # ours: not a change to adopt

    def _holds_ours(self, slot):
        """Whether self.state[slot.param] is still what this optimizer installed, as it installed it."""
        current = self.state.get(slot.param)
        if slot.blocks is not None:  # its copies, once assembled, may have been edited: read them back
            return current is slot.lazy and not slot.lazy.touched
        return bool(current) and all(current.get(k) is v for k, v in slot.views.items())

    def _adopt_state(self):
        """Entries of self.state replaced, removed, added or (split parameters) looked at, by a load, an
        offload/restore or a wrapper moving state: their values copied into the flat state, views reinstalled."""
        if isinstance(self.state, _Tracked) and not self.state.changed[0] and \
                not any(slot.lazy.touched for slot in self._split_slots):
            return  # nothing changed: no parameter walked
        stale = [slot for slot in self._slots.values() if not self._holds_ours(slot)]
        if not stale and len(self.state) == len(self._slots):
            if isinstance(self.state, _Tracked):
                self.state.changed[0] = False
            return
        for dst, src in self._state_writes(stale):
            dst.copy_(src)
        self._install_state(kept=self.state)  # views again where they were replaced

    def _state_writes(self, slots):
        """The writes that put self.state's entries of these slots into the flat state (_slot_writes)."""
        where = {id(p): w for p, w in self._params()}
        writes = []
        for slot in slots:
            saved = self.state.get(slot.param) or {}
            writes += self._slot_writes(slot, saved, f"state of {where.get(id(slot.param), 'a parameter')}")
        return writes

    def _slot_writes(self, slot, saved, where):
        """(destination, source) pairs that put `saved` (one parameter's state, parameter-shaped or in memory's
        form; empty: zeros) into the flat state. ValueError, before anything is written, if it does not fit."""
        if not saved:
            return [(t, torch.zeros(())) for e in slot.entries for t in e.state]
        keys = _STATE_KEYS[self._algorithm]
        if set(saved) - set(keys) - {"master_param", "step"} or any(k not in saved for k in keys):
            self._fail(f"{where} has keys {sorted(saved)}; expected {' and '.join(keys)} "
                       "(optionally master_param, step)")
        saved = {k: v for k, v in saved.items() if k != "step"}  # (its value is load_state_dict's)
        for key, src in saved.items():
            if not isinstance(src, torch.Tensor) or not src.is_floating_point():
                got = src.dtype if isinstance(src, torch.Tensor) else type(src).__name__
                self._fail(f"{where}: {key} is {got}, not a floating-point tensor")
        if slot.blocks is None:
            return self._entry_writes(slot.entries[0], saved, where)
        shape = tuple(slot.param.shape)
        for key, src in saved.items():
            if tuple(src.shape) != shape:
                self._fail(f"{where}: {key} has shape {tuple(src.shape)}, expected {shape} (the state of a "
                           "parameter split into QKV blocks is parameter-shaped)")
        writes = []
        for j, (e, block) in enumerate(zip(slot.entries, slot.blocks)):
            writes += self._entry_writes(e, {k: block.values(v) for k, v in saved.items()}, f"{where} (block {j})")
        return writes

    def _entry_writes(self, e, saved, where):
        """The pairs for one engine entry. NorMuon's moment2_buffer may take any of its forms
        (_reduce_moment2); a master_param is taken for a bf16/f16 parameter only (an fp32 one is its own)."""
        shape, writes = tuple(e.shape), []
        targets = dict(zip(_STATE_KEYS[e.algorithm], e.state), master_param=e.param if e.low_precision else None)
        for key, dst in targets.items():
            src = saved.get(key)
            if src is None:
                continue
            if key == "moment2_buffer":
                src = _reduce_moment2(src, shape, e.stats_per_row, where)
            elif tuple(src.shape) != shape:
                self._fail(f"{where}: {key} has shape {tuple(src.shape)}, expected {shape}")
            if dst is not None:
                writes.append((dst, src))
        return writes

    # ------------------------------------------------------------------------------------- the step

    def _init_group(self, group, skip_non_grad_params=True):
        """The hook Megatron's init_state_fn calls for every group before it loads a checkpoint: every
        parameter has state once the layout is built (the arguments follow Emerging-Optimizers')."""
        self._ensure_built()

    @torch.no_grad()
    def step(self, closure=None):
        """One step over every parameter with a gradient, then group['step'] += 1 in every group with
        parameters (TE FusedAdam's rule). Hyper-parameters are read (and checked) first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._settled_reason = None
        self._ensure_built()  # settles the previous step first (verdict='deferred')
        values = [self._hypers(i, self.param_groups[i]) for i in self._stepped]  # checked, in engine order
        steps = [self._group_step(i) for i in self._stepped]
        skipped = None
        if self.engine is not None:
            self.engine.set_nonfinite(self.nonfinite)
            self.engine.set_values(values)
            # Every parameter at its group's counter: the step about to run is group['step'] + 1, which
            # AdamW's bias correction reads (the core would count only steps with a gradient).
            self.engine.set_steps(steps)
            skipped = self.engine.step()
            self._refresh_split_state()
        # Deferred: this step's own verdict comes at the next one; what is reported now is the previous one's.
        self.last_skip_reason = skipped if skipped is not None else self._settled_reason
        if skipped is None:
            self._advanced = list(self._stepped)
            for i, t in zip(self._advanced, steps):
                self.param_groups[i]["step"] = t + 1
        return loss

    def _settle(self):
        """verdict='deferred' on CUDA: the previous step's NaN/Inf verdict. A skipped step changed nothing, so
        the counters step() advanced for it go back; nonfinite='error' raises here, one step late."""
        try:
            skipped = self.engine.settle()
        except RuntimeError:
            self._take_back()
            raise
        if skipped is not None:
            self._take_back()
            self.last_skip_reason = self._settled_reason = skipped
        self._advanced = []

    def _take_back(self):
        for i in self._advanced:
            if i < len(self.param_groups):
                self.param_groups[i]["step"] = max(0, self._group_step(i) - 1)
        self._advanced = []

    @property
    def backend(self):
        """'fast-cpu', 'fast-cuda' or 'reference-cpu' once built; before that the choice."""
        return self.engine.backend if self.engine is not None else self._choice

    # ------------------------------------------------------------------------------- state dicts

    def state_dict(self):
        """torch's structure, every tensor a fresh parameter-shaped fp32 copy (Megatron's distributed checkpoint
        requires it), with master_param for a bf16/f16 parameter; "state" is empty before the first step."""
        if self.engine is not None or any(self.state.values()):
            self._ensure_built()
        groups, state, index = [], {}, 0
        for i, g in enumerate(self.param_groups):
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(index, index + len(g["params"])))
            for p in g["params"]:
                slot = self._slots.get(id(p))
                if slot is not None:
                    state[index] = _assemble(slot.entries, slot.blocks, True)
                    if self._per_param_step:  # a fresh tensor per parameter: whoever loads it may share it
                        state[index]["step"] = torch.tensor(float(self._group_step(i)))
                index += 1
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """A state dict of the same groups and parameter counts, checked before anything is written. A group
        without 'step' takes a per-parameter 'step' if all agree (its value is read, the tensor never kept)."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            self._fail("not an optimizer state dict: expected the keys 'state' and 'param_groups'")
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            self._fail(f"the state dict has {len(saved_groups)} param groups, this optimizer {len(self.param_groups)}")
        self._ensure_built()
        writes, new_groups = [], []
        for i, (sg, g) in enumerate(zip(saved_groups, self.param_groups)):
            if len(sg["params"]) != len(g["params"]):
                self._fail(f"param_groups[{i}]: {len(sg['params'])} parameters saved, {len(g['params'])} here")
            new = {k: v for k, v in sg.items() if k != "params"}
            for k in self.defaults:
                new.setdefault(k, g[k])
            new["params"] = g["params"]
            self._hypers(i, new)
            per_param_steps = set()
            for index, p in zip(sg["params"], g["params"]):
                saved = saved_state.get(index) or {}
                where = f"state {index} (param_groups[{i}])"
                writes += self._slot_writes(self._slots[id(p)], saved, where)
                if "step" in saved:
                    per_param_steps.add(_step_value(self._label, saved["step"], where))
            if "step" in new:
                new["step"] = _step_value(self._label, new["step"], f"param_groups[{i}]")
            elif len(per_param_steps) > 1:
                self._fail(f"param_groups[{i}] has no 'step' and its parameters' steps differ: "
                           f"{sorted(per_param_steps)}")
            elif per_param_steps:
                new["step"] = per_param_steps.pop()
            new_groups.append(new)
        for dst, src in writes:
            dst.copy_(src)
        for g, new in zip(self.param_groups, new_groups):
            g.clear()
            g.update(new)
        self._install_state()


class MegatronNorMuon(_MegatronFlat):
    """NorMuon (docs/spec.md section 3) with the constructor of Megatron's TensorParallelAdaptiveMuon; what the
    adapter cannot run is refused, with the reason. docs/megatron.md maps the keywords onto the spec.
    Keyword-only extras: backend ('auto' | 'fast' | 'reference'; None reads NORMUON_BACKEND), threads (0: one
    per usable processor), nonfinite ('error' | 'skip_step'), verdict ('deferred', the default, | 'sync')."""

    _label = "MegatronNorMuon"
    _algorithm = "normuon"

    def __init__(self, params, lr=3e-4, momentum=0.95, nesterov=True, weight_decay=0.01,
                 use_decoupled_weight_decay=True, split_qkv=False, is_qkv_fn=None, qkv_split_shapes=None,
                 fp32_matmul_prec="medium", coefficient_type="simple", num_ns_steps=5, scale_mode="spectral",
                 extra_scale_factor=1.0, pg_collection=None, tp_mode="duplicated", use_syrk=False,
                 moment2_method="normuon", beta2=0.95, eps=1e-8, *, backend=None, threads=0, nonfinite="error",
                 verdict="deferred", _device_backend=None):
        if moment2_method != "normuon":
            self._fail(f"moment2_method={moment2_method!r}: this optimizer runs NorMuon only ('normuon'); use "
                       "Megatron's adaptive_muon for 'adamuon' or 'namo'")
        if use_decoupled_weight_decay not in (True,):
            self._fail(f"use_decoupled_weight_decay={use_decoupled_weight_decay!r}: only decoupled weight decay "
                       "(p <- p * (1 - lr * wd)) is implemented, not L2 decay added to the gradient")
        if coefficient_type not in COEFFICIENT_TYPES:
            hint = {"quintic": "Emerging-Optimizers' 'quintic' is a schedule of five different triples",
                    "polar_express": "Emerging-Optimizers' 'polar_express' (eight triples) is not the 5-triple "
                                     "schedule normuon implements"}.get(coefficient_type, "unknown here")
            self._fail(f"coefficient_type={coefficient_type!r} is not supported ({hint}); use 'simple' "
                       "(--muon-coefficient-type simple): Keller's quintic (3.4445, -4.7750, 2.0315) at every "
                       "iteration, the official NorMuon's orthogonaliser")
        if fp32_matmul_prec not in MATMUL_PRECISIONS and fp32_matmul_prec not in FOLLOWS_TORCH:
            choices = " | ".join(FOLLOWS_TORCH + tuple(MATMUL_PRECISIONS))
            self._fail(f"fp32_matmul_prec={fp32_matmul_prec!r}: choose {choices}")
        ns_precision = ns_precision_for(fp32_matmul_prec)
        if scale_mode not in SCALE_MODES:
            self._fail(f"scale_mode={scale_mode!r}: choose {' | '.join(SCALE_MODES)}")
        try:
            extra = float(extra_scale_factor)
        except (TypeError, ValueError):
            extra = float("nan")
        if not math.isfinite(extra) or extra <= 0:
            self._fail(f"extra_scale_factor={extra_scale_factor!r} must be a finite number > 0")
        if tp_mode not in TP_MODES:
            self._fail(f"tp_mode={tp_mode!r}: choose {' | '.join(TP_MODES)}")
        if qkv_split_shapes is not None:
            self._split_shapes(qkv_split_shapes, "qkv_split_shapes")
        lr_scale, c = SCALE_MODES[scale_mode]
        # What the layout and the plan are built from, checked by the core (num_ns_steps, nesterov).
        self._fixed = _checked(self._label, "constructor", "normuon",
                               dict(_native.defaults("normuon"), nesterov=nesterov, ns_steps=num_ns_steps,
                                    ns_coefficients=COEFFICIENT_TYPES[coefficient_type], ns_precision=ns_precision,
                                    reduce_axis="longer_dim", lr_scale=lr_scale, weight_decay_mode="decoupled",
                                    eps_placement="clamp"),
                               {"ns_steps": ("num_ns_steps", num_ns_steps), "nesterov": ("nesterov", nesterov)})
        self.split_qkv = bool(split_qkv)
        self.is_qkv_fn = is_qkv_fn if is_qkv_fn is not None else _is_qkv
        self.qkv_split_shapes = qkv_split_shapes
        self.pg_collection = pg_collection
        self.tp_mode = tp_mode
        self.use_syrk = use_syrk  # a CUDA kernel choice: no effect here
        self.coefficient_type = coefficient_type
        self.num_ns_steps = num_ns_steps
        self.scale_mode = scale_mode
        self.extra_scale_factor = extra
        self.fp32_matmul_prec = fp32_matmul_prec
        self.moment2_method = moment2_method
        self.nesterov = self._fixed["nesterov"]
        # The spec has no free scale factor; an extra constant is folded into the learning rate and out of
        # the weight decay: p(1 - lr*wd) - lr*k*U  ==  p(1 - (k*lr)(wd/k)) - (k*lr)*U  (exact up to rounding).
        self._fold = c * extra
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, beta2=beta2, eps=eps)
        self._setup(params, defaults, backend, threads, nonfinite, verdict, _device_backend)

    def _tp_size(self, p):
        """Ranks the parameter is sharded over (1 without pg_collection): Megatron's expert TP group for expert
        weights, else TP (a process group, or anything with size(), so tests can pass stand-ins)."""
        group = getattr(self.pg_collection, "expt_tp" if getattr(p, "expert_tp", False) else "tp", None)
        if group is None:
            return 1
        size = getattr(group, "size", None)
        if callable(size):
            return int(size())
        import torch.distributed as dist

        return int(dist.get_world_size(group))

    def _check_param(self, p, where):
        if p.dim() != 2:
            experts = (" A weight of 3 dimensions may hold every expert of a MoE layer (--moe-single-grouped-weight): "
                       "keep the experts' weights apart (TEGroupedMLP: --moe-grouped-gemm without "
                       "--moe-single-grouped-weight), which this optimizer steps as matrices of their own"
                       if p.dim() == 3 else "")
            self._fail(f"{where} has shape {list(p.shape)}: NorMuon needs whole 2-D matrices. Megatron routes "
                       "non-matrix parameters to Adam; under --use-distributed-optimizer the emerging-optimizer "
                       "path shards whole matrices per rank (LayerWise), never 1-D fragments." + experts)
        super()._check_param(p, where)
        # Megatron's tensor-parallel metadata: the parameter is one rank's slice along partition_dim.
        tp_sharded = getattr(p, "tensor_model_parallel", False) and getattr(p, "partition_dim", -1) not in (-1, None)
        size = self._tp_size(p) if tp_sharded else 1
        if size > 1 and self.tp_mode != "blockwise":
            self._fail(f"{where} (local shape {list(p.shape)}) is a tensor-parallel shard along dim "
                       f"{p.partition_dim} over {size} ranks, and tp_mode={self.tp_mode!r} needs the whole "
                       "matrix, which this adapter does not gather yet. Use tp_mode='blockwise' "
                       "(--muon-tp-mode blockwise: each rank runs NorMuon on its own shard, so the result "
                       "depends on the TP size), or tensor (and expert tensor) parallel size 1")
        self._blocks(p, where)

    @staticmethod
    def _split_shapes(shapes, where):
        try:
            sizes = [int(s) for s in shapes]
            ok = len(sizes) >= 1 and all(s > 0 and s == t for s, t in zip(sizes, shapes))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"MegatronNorMuon: {where}={shapes!r} is not a list of positive integers")
        return sizes

    def _blocks(self, p, where):
        """Megatron's split_qkv: the rows are [query group][q | k | v rows] (qkv_split_shapes per group, a
        gate block too when attention_output_gate is on); block j gathers its rows of every query group."""
        if not (self.split_qkv and self.is_qkv_fn(p)):
            return None
        shapes = getattr(p, "qkv_split_shapes", None)
        if shapes is None:
            shapes = self.qkv_split_shapes
        if shapes is None:
            self._fail(f"{where} is a QKV weight and split_qkv is on, but neither the parameter nor the "
                       "optimizer has qkv_split_shapes; set p.qkv_split_shapes, or pass split_qkv=False "
                       "(--muon-no-split-qkv) to orthogonalise it whole")
        sizes = self._split_shapes(shapes, f"{where}: qkv_split_shapes")
        rows, total = p.shape[0], sum(sizes)
        if rows % total:
            self._fail(f"{where} has {rows} rows, not a multiple of sum(qkv_split_shapes) = {total} ({sizes})")
        return split_rows(p, sizes)

    def _hypers(self, i, group):
        """The spec's values for one group (docs/megatron.md tabulates the mapping); ValueError names it."""
        where, label = f"param_groups[{i}]", self._label
        given = {field: (key, _number(label, where, group, key)) for field, key in
                 (("lr", "lr"), ("weight_decay", "weight_decay"), ("beta1", "momentum"), ("beta2", "beta2"),
                  ("denom_eps", "eps"))}
        values = dict(self._fixed, **{field: value for field, (_, value) in given.items()})
        values["lr"], values["weight_decay"] = values["lr"] * self._fold, values["weight_decay"] / self._fold
        folded = f" (as {values['lr']!r}, times the folded scale {self._fold:g})" if self._fold != 1 else ""
        return _checked(label, where, "normuon", values, given, {"lr": folded})


class MegatronAdamW(_MegatronFlat):
    """This project's AdamW (docs/spec.md section 4) with the constructor of TE's FusedAdam / torch.optim.AdamW,
    for Megatron's Adam groups; what it does not implement is refused, with the reason (docs/megatron.md).
    Keyword-only extras: backend, threads, nonfinite, verdict (as MegatronNorMuon)."""

    _label = "MegatronAdamW"
    _algorithm = "adamw"
    _per_param_step = True  # read by torch's and Megatron's no-TE paths

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 bias_correction=True, adam_w_mode=True, capturable=False, master_weights=False,
                 master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 use_decoupled_grad=False, store_param_remainders=False, set_grad_none=None, maximize=False,
                 foreach=None, fused=None, differentiable=False, backend=None, threads=0, nonfinite="error",
                 verdict="deferred", _device_backend=None):
        precision = ("master_weights, exp_avg_dtype, exp_avg_sq_dtype, use_decoupled_grad and "
                     "store_param_remainders are TE's precision-aware options (--use-precision-aware-optimizer), "
                     "which this optimizer does not implement: Megatron keeps fp32 master weights and state")
        refused = {"amsgrad": (amsgrad, "AMSGrad is not implemented"),
                   "capturable": (capturable, "CUDA graph capture (--optimizer-cuda-graph) needs the CUDA backend"),
                   "maximize": (maximize, "only minimisation is implemented"),
                   "differentiable": (differentiable, "the step is not differentiable"),
                   "master_weights": (master_weights, precision),
                   "use_decoupled_grad": (use_decoupled_grad, precision),
                   "store_param_remainders": (store_param_remainders, precision)}
        for name, (value, why) in refused.items():
            if value:
                self._fail(f"{name}={value!r}: {why}")
        for name, value in (("master_weight_dtype", master_weight_dtype), ("exp_avg_dtype", exp_avg_dtype),
                            ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if value != torch.float32:
                self._fail(f"{name}={value!r}: {precision}")
        if adam_w_mode not in (True, 1):
            self._fail(f"adam_w_mode={adam_w_mode!r}: only decoupled weight decay (AdamW, p <- p * (1 - lr * wd)) "
                       "is implemented, not Adam's L2 decay added to the gradient (Megatron passes "
                       "adam_w_mode=config.decoupled_weight_decay: keep it True)")
        if bias_correction not in (True, 1):
            self._fail(f"bias_correction={bias_correction!r}: only bias-corrected AdamW is implemented")
        self.set_grad_none = set_grad_none  # only zero_grad()'s default; foreach and fused have no effect
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        self._setup(params, defaults, backend, threads, nonfinite, verdict, _device_backend)

    def _hypers(self, i, group):
        where, label = f"param_groups[{i}]", self._label
        betas = group.get("betas")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            self._fail(f"{where}: betas={betas!r} is not a pair")
        if group.get("bias_correction", True) not in (True, 1):
            self._fail(f"{where}: bias_correction={group['bias_correction']!r}: only bias-corrected AdamW is "
                       "implemented")
        given = {"beta1": ("betas[0]", _as_number(label, where, "betas[0]", betas[0])),
                 "beta2": ("betas[1]", _as_number(label, where, "betas[1]", betas[1]))}
        given.update({k: (k, _number(label, where, group, k)) for k in ("lr", "eps", "weight_decay")})
        return _checked(label, where, "adamw", {field: value for field, (_, value) in given.items()}, given)

    def zero_grad(self, set_to_none=None):
        """TE FusedAdam's default: gradients set to None (or set_grad_none's value when given)."""
        if set_to_none is None:
            set_to_none = True if self.set_grad_none is None else bool(self.set_grad_none)
        super().zero_grad(set_to_none=set_to_none)


# ------------------------------------------------------------------------------------- registration

def init_state_fn(opt, config=None):
    """Megatron's init_state_fn contract: state for every parameter, with or without a gradient."""
    for group in opt.param_groups:
        opt._init_group(group, skip_non_grad_params=False)


# MegatronAdamW's is the same. (Megatron's own Adam init_state_fn, zero tensors put into opt.state, works too.)
adamw_init_state_fn = init_state_fn


def config_to_kwargs(config, model_chunks=None, pg_collection=None, *, backend=None, threads=0):
    """MegatronNorMuon's keyword arguments from a Megatron OptimizerConfig (CONFIG_FIELDS)."""
    kwargs = {}
    for name, fields in CONFIG_FIELDS.items():
        for field in fields:
            if hasattr(config, field):
                kwargs[name] = getattr(config, field)
                break
    kwargs.update(is_qkv_fn=_is_qkv, pg_collection=pg_collection, backend=backend, threads=threads)
    return kwargs


# Megatron applies config.muon_scalar_optimizer to the non-matrix parameters only for these registry names.
REROUTED_NAMES = ("muon", "adaptive_muon")


def check_scalar_routing(name, config):
    """Registered under another name, Megatron keeps the registry's 'adam' for embeddings, the output head,
    norms and biases and ignores --muon-scalar-optimizer: refuse that rather than run Adam silently."""
    scalar = getattr(config, "muon_scalar_optimizer", "adam")
    if name not in REROUTED_NAMES and scalar != "adam":
        raise ValueError(f"normuon.megatron: muon_scalar_optimizer={scalar!r} (--muon-scalar-optimizer), but "
                         f"Megatron reroutes the non-matrix parameters to it only for the optimizer names "
                         f"{' and '.join(map(repr, REROUTED_NAMES))}; registered as {name!r} they would silently "
                         "get Adam. Use --muon-scalar-optimizer adam, or register(name='muon', "
                         "replace_existing=True) and --optimizer muon so that Megatron applies it")


def megatron_core_version():
    """The installed megatron-core version string, or None when it cannot be told."""
    for module_name in ("megatron.core.package_info", "megatron.core"):
        try:
            version = getattr(importlib.import_module(module_name), "__version__", None)
        except ImportError:
            continue
        if isinstance(version, str) and version:
            return version
    try:
        from importlib import metadata

        return metadata.version("megatron-core")
    except Exception:  # noqa: BLE001 - not installed as a distribution, or no metadata
        return None


def check_version(version, allow_untested_version=False):
    """RuntimeError naming the version outside KNOWN_GOOD_VERSIONS, or when it cannot be told, unless
    allow_untested_version."""
    if allow_untested_version:
        return
    low, high = KNOWN_GOOD_VERSIONS
    known = f"{low[0]}.{low[1]} to {high[0]}.{high[1]}"
    match = re.match(r"\s*(\d+)\.(\d+)", version or "")
    if match is None:
        raise RuntimeError(f"normuon.megatron.register: cannot tell the megatron-core version (found {version!r}); "
                           f"the adapter knows megatron-core {known}. Pass allow_untested_version=True to register "
                           "anyway")
    found = (int(match.group(1)), int(match.group(2)))
    if not low <= found <= high:
        why = ("before 0.18 Megatron has no emerging-optimizer registry" if found < low else
               "newer than any release it was checked against")
        raise RuntimeError(f"normuon.megatron.register: megatron-core {version} is outside the known-good range "
                           f"{known} ({why}). Pass allow_untested_version=True to register anyway")


def _megatron(caller, allow_untested_version):
    """megatron.core.optimizer, its emerging_optimizers module and the version, once the version gate has
    passed (RuntimeError when megatron-core is not importable)."""
    try:
        modules = (importlib.import_module("megatron.core.optimizer"),
                   importlib.import_module("megatron.core.optimizer.emerging_optimizers"))
    except ImportError as error:
        raise RuntimeError(f"normuon.megatron.{caller}: megatron-core is not importable ({error})") from None
    version = megatron_core_version()
    check_version(version, allow_untested_version)
    return (*modules, version)


def _check_adam_hooks(mopt, version):
    missing = [a for a in ("Adam", "USING_PYTORCH_OPTIMIZER") if not hasattr(mopt, a)]
    if missing:
        raise RuntimeError(f"normuon.megatron: megatron-core {version}: megatron.core.optimizer lacks "
                           f"{', '.join(missing)} (the module globals replace_adam sets)")


def _set_adam(mopt, backend, threads):
    """MegatronAdamW (with backend/threads as its defaults: Megatron passes neither) as Megatron's Adam, and
    USING_PYTORCH_OPTIMIZER off (without TE/Apex Megatron would otherwise call torch.optim.AdamW directly)."""
    cls = MegatronAdamW
    if backend is not None or threads:
        class Bound(MegatronAdamW):
            def __init__(self, *args, **kwargs):
                kwargs.setdefault("backend", backend)
                kwargs.setdefault("threads", threads)
                super().__init__(*args, **kwargs)

        Bound.__name__ = Bound.__qualname__ = "MegatronAdamW"
        cls = Bound
    mopt.Adam = cls
    mopt.USING_PYTORCH_OPTIMIZER = False
    return cls


def replace_adam(*, allow_untested_version=False, backend=None, threads=0):
    """Makes Megatron build MegatronAdamW wherever it builds its Adam (module globals: Megatron has no Adam
    registry), with register()'s version gate and fail-closed checks. Returns the class."""
    mopt, _, version = _megatron("replace_adam", allow_untested_version)
    _check_adam_hooks(mopt, version)
    return _set_adam(mopt, backend, threads)


def register(name="normuon", *, replace_existing=False, replace_adam=False, allow_untested_version=False,
             backend=None, threads=0):
    """Adds MegatronNorMuon to Megatron's emerging-optimizer registry under `name` (its parameter routing
    copied from Megatron's muon entry); with replace_adam=True, Megatron's Adam groups get MegatronAdamW too.
    Returns the entry. Fails closed (RuntimeError, nothing touched) as docs/megatron.md tells; taking over an
    entry Megatron has needs replace_existing=True. backend/threads go to every optimizer it builds."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"normuon.megatron.register: name={name!r} must be a non-empty string")
    mopt, eo, version = _megatron("register", allow_untested_version)
    missing = [a for a in ("_EMERGING_OPTIMIZERS", "EmergingOptimizerEntry") if not hasattr(eo, a)]
    if missing or not isinstance(getattr(eo, "_EMERGING_OPTIMIZERS", None), dict):
        raise RuntimeError(f"normuon.megatron.register: megatron-core {version}: megatron.core.optimizer."
                           f"emerging_optimizers lacks {', '.join(missing) or 'a dict registry'} (the "
                           "emerging-optimizer registry this adapter plugs into)")
    if replace_adam:
        _check_adam_hooks(mopt, version)
    registry = eo._EMERGING_OPTIMIZERS
    existing = registry.get(name)
    ours = getattr(existing, "optimizer_cls", None)
    if existing is not None and not (isinstance(ours, type) and issubclass(ours, MegatronNorMuon)) \
            and not replace_existing:
        cls = getattr(ours, "__name__", type(existing).__name__)
        raise ValueError(f"normuon.megatron.register: '{name}' is already Megatron's {cls}; pass "
                         "replace_existing=True to take it over")
    template = registry.get("adaptive_muon") or registry.get("muon")

    def to_kwargs(config, model_chunks=None, pg_collection=None):
        check_scalar_routing(name, config)
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
        mopt.HAVE_EMERGING_OPTIMIZERS = True  # the emerging path refuses to run without Emerging-Optimizers
    if replace_adam:
        _set_adam(mopt, backend, threads)
    return entry


__all__ = ["MegatronNorMuon", "MegatronAdamW", "register", "replace_adam", "init_state_fn", "adamw_init_state_fn",
           "config_to_kwargs", "check_scalar_routing", "ns_precision_for", "check_version", "megatron_core_version",
           "KNOWN_GOOD_VERSIONS", "CONFIG_FIELDS"]
