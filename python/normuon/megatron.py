"""normuon.megatron: NorMuon (and the AdamW half) for Megatron-LM. docs/megatron.md tells how Megatron's
settings map onto the spec and what the adapter does with Megatron's wrappers.

    import normuon.megatron
    normuon.megatron.register()          # once, before get_megatron_optimizer() / pretrain()
    config = OptimizerConfig(optimizer="normuon", muon_coefficient_type="simple", ...)

Megatron is imported only inside register() and replace_adam().
"""
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

# megatron-core (major, minor) releases this adapter was written against, inclusive (0.18 brought the registry).
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

# Constructor keyword -> OptimizerConfig fields, first found wins. moment2_method is absent: choosing this
# optimizer is choosing NorMuon (the config's adaptive_muon_moment2_method is Megatron's adaptive_muon's).
CONFIG_FIELDS = {
    "lr": ("lr",), "weight_decay": ("weight_decay",), "momentum": ("muon_momentum",), "nesterov": ("muon_nesterov",),
    "use_decoupled_weight_decay": ("muon_use_decoupled_weight_decay", "use_decoupled_weight_decay"),
    "split_qkv": ("muon_split_qkv",), "fp32_matmul_prec": ("muon_fp32_matmul_prec",),
    "coefficient_type": ("muon_coefficient_type",), "num_ns_steps": ("muon_num_ns_steps",),
    "scale_mode": ("muon_scale_mode",), "extra_scale_factor": ("muon_extra_scale_factor",),
    "tp_mode": ("muon_tp_mode",), "use_syrk": ("muon_use_syrk",),
    "beta2": ("adaptive_muon_beta2",), "eps": ("adaptive_muon_eps",),
}

# Each algorithm's two state tensors, as Emerging-Optimizers and torch's AdamW name them.
_STATE_KEYS = {"normuon": ("momentum_buffer", "moment2_buffer"), "adamw": ("exp_avg", "exp_avg_sq")}


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
    return bool(getattr(p, "is_qkv", False))  # Megatron's tag on its fused QKV weights


class _Tracked(dict):
    """self.state and its per-parameter dicts: a change through their methods (by Megatron's wrappers or
    torch's machinery) sets the flag they share, so that a step tells in O(1) that nothing changed."""

    def __init__(self, changed, *args):
        super().__init__(*args)
        self.changed = changed  # [bool]

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
    access (then touched). Copies and pickles as a plain dict; refers to the engine entries, not the optimizer."""

    def __init__(self, entries, blocks):
        self._entries, self._blocks, self._data = entries, blocks, None

    @property
    def touched(self):
        return self._data is not None

    def _values(self):
        if self._data is None:
            self._data = _assemble(self._entries, self._blocks, False)
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

    def __reduce__(self):  # copy, deepcopy, pickle, torch.save: the plain dict
        return dict, (self.copy(),)


class _Slot:
    """One parameter of param_groups, where it sits, and its engine entries: one for the parameter itself
    (blocks is None), or one per block of rows (a split QKV weight: RowBlocks, stepped in place)."""

    __slots__ = ("param", "where", "entries", "blocks", "views", "lazy")

    def __init__(self, param, where, entries, blocks):
        self.param, self.where, self.entries, self.blocks = param, where, entries, blocks
        self.views = _in_memory(entries[0]) if blocks is None else None  # self.state[param], live
        self.lazy = None  # the _SplitState installed in self.state for a split parameter

    def fresh_state(self):
        self.lazy = _SplitState(self.entries, self.blocks)
        return self.lazy

    def holds(self, current):
        """Whether self.state[param] is as installed (a split one's copies, once looked at, may be edited)."""
        if self.blocks is not None:
            return current is self.lazy and not self.lazy.touched
        return bool(current) and all(current.get(k) is v for k, v in self.views.items())


def _in_memory(e):
    """An engine entry's state as live views; NorMuon's moment2_buffer [m, 1] or [1, n] as Emerging-Optimizers'."""
    views = dict(zip(_STATE_KEYS[e.algorithm], e.state))
    if e.algorithm == "normuon":
        m, n = e.shape
        views["moment2_buffer"] = e.state[1].view((m, 1) if e.stats_per_row else (1, n))
    return views


def _assemble(entries, blocks, master):
    """A parameter's state as fresh parameter-shaped fp32 copies (moment2_buffer expanded; with master,
    master_param too for a bf16/f16 parameter), from its one entry or from its blocks'."""
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
        out[key] = torch.empty(blocks[0].param_shape, dtype=torch.float32, device=parts[0][key].device)
        for part, block in zip(parts, blocks):
            block.write(out[key], part[key])
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
    """What MegatronNorMuon and MegatronAdamW share (docs/megatron.md, "What the adapter does with Megatron's
    wrappers"): an engine over the parameters param_groups holds now, built lazily and again when they change."""

    _label = None
    _algorithm = None
    _group_keys = None  # {spec field: the group's key}, read at every step
    _fixed = None  # the spec's other values, which the layout is built from (None: the spec's defaults)
    _fold = 1.0  # a constant folded into lr and out of weight_decay (MegatronNorMuon's scale factor)
    _per_param_step = False  # state_dict() adds each parameter's 'step' (torch's AdamW has one)

    def __init__(self, params, defaults, backend, threads, nonfinite, verdict, device_backend):
        """Last in the subclasses' constructors. device_backend: the tests' emulated CUDA engine."""
        _native.require(self._label)
        try:
            self._choice = resolve_modes(backend, nonfinite, verdict)
        except ValueError as error:
            self._fail(str(error))
        self.nonfinite, self.verdict, self._threads, self._device_backend = nonfinite, verdict, threads, device_backend
        self.engine = None      # the engine over the current parameters, built lazily
        self._signature = None  # what it was built for
        self._slots = {}        # id(param) -> _Slot
        self._split_slots = []  # the slots of parameters split into row blocks
        self._stepped = []      # the param_groups with parameters (the engine's groups, in its order)
        self._advanced = []     # groups whose step the last step() advanced (taken back if it was skipped)
        self._settled_reason = None  # why the previous step was skipped, learnt when it was settled
        self.last_skip_reason = None
        super().__init__(params, defaults)
        for i, g in enumerate(self.param_groups):
            for k, p in enumerate(g["params"]):
                self._check_param(p, f"param_groups[{i}]['params'][{k}]")

    def _fail(self, message):
        raise ValueError(f"{self._label}: {message}") from None

    def _check_param(self, p, where):
        """Refuses what no parameter may be (MegatronAdamW takes any shape: DistOpt hands over 1-D shards, some
        empty). Returns None, or the RowBlocks that the engine steps as matrices of their own."""
        if p.device.type not in ("cpu", "cuda"):
            self._fail(f"{where} is on {p.device}: normuon runs on CPU or CUDA tensors")
        if p.dtype not in DTYPES:
            self._fail(f"{where} is {p.dtype}; float32, bfloat16 or float16 expected")
        if p.is_sparse:
            self._fail(f"{where} is sparse")

    def _number(self, where, group, key):
        """group[key] as a float, from a number or a one-element tensor (the scheduler may fill_() lr)."""
        if key not in group:
            self._fail(f"{where} has no '{key}'")
        value = group[key]
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                self._fail(f"{where}: {key} is a tensor of shape {tuple(value.shape)}, not a scalar")
            value = value.item()
        try:
            return float(value)
        except (TypeError, ValueError):
            self._fail(f"{where}: {key}={value!r} is not a number")

    def _checked(self, where, values, given, lr_note=""):
        """values checked by the core; a refusal names the key and value (given: {field: (key, value)}) it came from."""
        try:
            return _native.check_values(where, self._algorithm, values)
        except ValueError as error:  # an OptionError names its field; a schedule too long, a missing value do not
            field = error.key.rsplit(".", 1)[-1] if isinstance(error, _native.OptionError) else None
            if field not in given or not error.value:
                self._fail(str(error))
            key, value = given[field]
            self._fail(f"{where}: {key}={value!r}{lr_note if field == 'lr' else ''} {error.problem}")

    def _hypers(self, i, group):
        """The spec's values for param_groups[i] (docs/megatron.md tabulates the mapping), checked."""
        where = f"param_groups[{i}]"
        given = {field: (key, self._number(where, group, key)) for field, key in self._group_keys.items()}
        values = dict(self._fixed or {}, **{field: value for field, (_, value) in given.items()})
        values["lr"], values["weight_decay"] = values["lr"] * self._fold, values["weight_decay"] / self._fold
        folded = f" (as {values['lr']!r}, times the folded scale {self._fold:g})" if self._fold != 1 else ""
        return self._checked(where, values, given, folded)

    def _step_value(self, step, where):
        """A step counter (an int, or a one-element tensor as torch keeps per-parameter steps) as an int >= 0."""
        value = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
        try:
            number = int(value)
            ok = not isinstance(value, bool) and number == value and number >= 0
        except (TypeError, ValueError, OverflowError):
            ok = False
        if not ok:
            self._fail(f"{where}: step={step!r} is not a non-negative integer")
        return number

    def _group_step(self, i):
        return self._step_value(self.param_groups[i].get("step", 0), f"param_groups[{i}]")

    # --------------------------------------------------------------------------- the flat layout

    def _ensure_built(self):
        """The layout matches param_groups; self.state's entries that someone replaced, removed, added or (split
        parameters) looked at since (a load, an offload/restore, a wrapper moving state) are copied in."""
        if self.engine is not None:
            self._settle()  # the previous step's deferred verdict, before its counters or state are read
        # Megatron swaps the tensor objects; a bound tensor changed in place is refused by the engine's step.
        signature = tuple(tuple(map(id, g["params"])) for g in self.param_groups)
        if signature != self._signature:
            return self._rebuild(signature)
        if isinstance(self.state, _Tracked) and not self.state.changed[0] and \
                not any(slot.lazy.touched for slot in self._split_slots):
            return  # nothing changed: no parameter walked
        stale = [slot for slot in self._slots.values() if not slot.holds(self.state.get(slot.param))]
        if not stale and len(self.state) == len(self._slots):
            if isinstance(self.state, _Tracked):
                self.state.changed[0] = False
            return
        for dst, src in self._state_writes(stale):
            dst.copy_(src)
        self._install_state(kept=self.state)  # views again where they were replaced

    def _rebuild(self, signature):
        """A new engine over the parameters param_groups holds now: state from self.state, fp32 masters and
        counters from the previous engine (Engine.carry_from); parameters that left the groups lose theirs."""
        stepped = [i for i, g in enumerate(self.param_groups) if len(g["params"])]
        groups, plan, all_blocks = [], [], {}
        for i in stepped:
            tensors, names = [], []
            for k, p in enumerate(self.param_groups[i]["params"]):
                where = f"param_groups[{i}]['params'][{k}]"
                blocks = self._check_param(p, where)  # each stepped where it lies in p, as a matrix of its own
                keys = [p] if blocks is None else [b.key for b in blocks]
                all_blocks.update((id(b.key), b) for b in blocks or ())
                plan.append((p, where, keys, blocks))
                tensors += keys
                names += [f"g{i}.p{k}"] if blocks is None else [f"g{i}.p{k}.b{j}" for j in range(len(blocks))]
            groups.append(dict(params=tensors, names=names, name=f"g{i}", algorithm=self._algorithm))
        engine, slots = None, {}
        if groups:
            # The spec's values stand in until step() hands over the groups' own (Megatron builds with
            # lr=None and lets its scheduler set it); the fixed ones (layout, plan) are final.
            values = _native.check_values("defaults", self._algorithm, self._fixed or _native.defaults(self._algorithm))
            aw = _native.defaults("adamw")
            try:
                planned, entries = plan_groups(groups, _native.defaults("normuon"),
                                               dict(aw, betas=(aw["beta1"], aw["beta2"])), {}, {}, all_blocks)
                engine = Engine(entries, [(g["name"], self._algorithm, values) for g in planned], self._choice,
                                threads=self._threads, nonfinite=self.nonfinite, verdict=self.verdict,
                                device_backend=self._device_backend)
            except ValueError as error:
                self._fail(f"{error} (gI.pK is param_groups[I]['params'][K])")
            by_key = {id(e.tensor): e for e in engine.entries}
            for p, where, keys, blocks in plan:
                slots[id(p)] = _Slot(p, where, [by_key[id(t)] for t in keys], blocks)
        # The values: check everything first, then write (the previous views stay valid until then).
        writes = self._state_writes(slots.values())
        if engine is not None and self.engine is not None:
            # The fp32 masters with their low bits, and the counters (the state is written below).
            engine.carry_from(self.engine, [self._group_step(i) for i in stepped])
        for dst, src in writes:
            dst.copy_(src)
        self.engine, self._slots, self._stepped, self._signature = engine, slots, stepped, signature
        self._split_slots = [slot for slot in slots.values() if slot.blocks is not None]
        self._install_state()

    def _install_state(self, kept=None):
        """self.state: live views of the engine's buffers, a _SplitState for a split parameter; kept: the state
        whose split mappings stay, ours or not (a held handle counts until the next step refreshes it)."""
        changed = [False]
        self.state = _Tracked(changed)
        for slot in self._slots.values():
            if slot.blocks is None:
                value = _Tracked(changed, slot.views)
            else:
                value = None if kept is None else kept.get(slot.param)
                if value is None or (value is not slot.lazy and not len(value)):  # (len() would assemble ours)
                    value = slot.fresh_state()
            dict.__setitem__(self.state, slot.param, value)

    def _state_writes(self, slots):
        return [w for s in slots for w in self._slot_writes(s, self.state.get(s.param) or {}, f"state of {s.where}")]

    def _slot_writes(self, slot, saved, where):
        """(destination, source) pairs that put `saved` (one parameter's state, in any of its forms; empty: zeros)
        into the flat state, checked; master_param is taken for a bf16/f16 parameter only (fp32 is its own)."""
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
            if slot.blocks is not None and src.shape != slot.param.shape:
                self._fail(f"{where}: {key} has shape {tuple(src.shape)}, expected {tuple(slot.param.shape)} (the "
                           "state of a parameter split into QKV blocks is parameter-shaped)")
        parts = [(slot.entries[0], saved, where)] if slot.blocks is None else [
            (e, {k: block.values(v) for k, v in saved.items()}, f"{where} (block {j})")
            for j, (e, block) in enumerate(zip(slot.entries, slot.blocks))]
        writes = []
        for e, part, at in parts:
            shape = tuple(e.shape)
            targets = dict(zip(_STATE_KEYS[e.algorithm], e.state), master_param=e.param if e.low_precision else None)
            for key, dst in targets.items():
                src = part.get(key)
                if src is None:
                    continue
                if key == "moment2_buffer":
                    src = _reduce_moment2(src, shape, e.stats_per_row, at)
                elif tuple(src.shape) != shape:
                    self._fail(f"{at}: {key} has shape {tuple(src.shape)}, expected {shape}")
                if dst is not None:
                    writes.append((dst, src))
        return writes

    # ------------------------------------------------------------------------------------- the step

    def _init_group(self, group, skip_non_grad_params=True):
        """Megatron's init_state_fn hook (Emerging-Optimizers' arguments): state for every parameter."""
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
        values = [self._hypers(i, self.param_groups[i]) for i in self._stepped]  # in engine order
        steps = [self._group_step(i) for i in self._stepped]
        skipped = None
        if self.engine is not None:
            self.engine.set_nonfinite(self.nonfinite)
            self.engine.set_values(values)
            # Every parameter at its group's counter: the step about to run is group['step'] + 1, which
            # AdamW's bias correction reads (the core would count only steps with a gradient).
            self.engine.set_steps(steps)
            skipped = self.engine.step()
            for slot in self._split_slots:  # copies looked at or replaced are stale now: a fresh mapping
                if not slot.holds(self.state.get(slot.param)):
                    dict.__setitem__(self.state, slot.param, slot.fresh_state())  # ours: not a change to adopt
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
            groups.append(dict({k: v for k, v in g.items() if k != "params"},
                               params=list(range(index, index + len(g["params"])))))
            for p in g["params"]:
                slot = self._slots.get(id(p))
                if slot is not None:
                    state[index] = _assemble(slot.entries, slot.blocks, True)
                    if self._per_param_step:  # a fresh tensor per parameter: whoever loads it may share it
                        state[index]["step"] = torch.tensor(float(self._group_step(i)))
                index += 1
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
                    per_param_steps.add(self._step_value(saved["step"], where))
            if "step" in new:
                new["step"] = self._step_value(new["step"], f"param_groups[{i}]")
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
    _group_keys = {"lr": "lr", "weight_decay": "weight_decay", "beta1": "momentum", "beta2": "beta2",
                   "denom_eps": "eps"}

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
        self._one_of("fp32_matmul_prec", fp32_matmul_prec, FOLLOWS_TORCH + tuple(MATMUL_PRECISIONS))
        ns_precision = ns_precision_for(fp32_matmul_prec)
        self._one_of("scale_mode", scale_mode, SCALE_MODES)
        try:
            extra = float(extra_scale_factor)
        except (TypeError, ValueError):
            extra = float("nan")
        if not math.isfinite(extra) or extra <= 0:
            self._fail(f"extra_scale_factor={extra_scale_factor!r} must be a finite number > 0")
        self._one_of("tp_mode", tp_mode, TP_MODES)
        if qkv_split_shapes is not None:
            self._split_shapes(qkv_split_shapes, "qkv_split_shapes")
        lr_scale, c = SCALE_MODES[scale_mode]
        # What the layout and the plan are built from, checked by the core (num_ns_steps, nesterov).
        self._fixed = self._checked("constructor", dict(
            _native.defaults("normuon"), nesterov=nesterov, ns_steps=num_ns_steps, ns_precision=ns_precision,
            ns_coefficients=COEFFICIENT_TYPES[coefficient_type], reduce_axis="longer_dim", lr_scale=lr_scale,
            weight_decay_mode="decoupled", eps_placement="clamp"),
            {"ns_steps": ("num_ns_steps", num_ns_steps), "nesterov": ("nesterov", nesterov)})
        self.split_qkv = bool(split_qkv)
        self.is_qkv_fn = is_qkv_fn if is_qkv_fn is not None else _is_qkv
        self.qkv_split_shapes, self.pg_collection, self.tp_mode = qkv_split_shapes, pg_collection, tp_mode
        self.use_syrk = use_syrk  # a CUDA kernel choice: no effect here
        # The rest as given, for whoever reads them back.
        self.coefficient_type, self.num_ns_steps, self.moment2_method = coefficient_type, num_ns_steps, moment2_method
        self.scale_mode, self.extra_scale_factor, self.fp32_matmul_prec = scale_mode, extra, fp32_matmul_prec
        self.nesterov = self._fixed["nesterov"]
        # The spec has no free scale factor; an extra constant is folded into the learning rate and out of
        # the weight decay: p(1 - lr*wd) - lr*k*U  ==  p(1 - (k*lr)(wd/k)) - (k*lr)*U  (exact up to rounding).
        self._fold = c * extra
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, beta2=beta2, eps=eps)
        super().__init__(params, defaults, backend, threads, nonfinite, verdict, _device_backend)

    def _one_of(self, name, value, choices):
        if value not in choices:
            self._fail(f"{name}={value!r}: choose {' | '.join(choices)}")

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
        # Megatron's tensor-parallel metadata: p is one rank's slice along partition_dim, over the expert TP group
        # for expert weights, else TP (a process group, or anything with size(): the tests' stand-ins).
        size = 1
        if getattr(p, "tensor_model_parallel", False) and getattr(p, "partition_dim", -1) not in (-1, None):
            group = getattr(self.pg_collection, "expt_tp" if getattr(p, "expert_tp", False) else "tp", None)
            if group is not None:
                size = int(group.size() if callable(getattr(group, "size", None)) else
                           torch.distributed.get_world_size(group))
        if size > 1 and self.tp_mode != "blockwise":
            self._fail(f"{where} (local shape {list(p.shape)}) is a tensor-parallel shard along dim "
                       f"{p.partition_dim} over {size} ranks, and tp_mode={self.tp_mode!r} needs the whole "
                       "matrix, which this adapter does not gather yet. Use tp_mode='blockwise' "
                       "(--muon-tp-mode blockwise: each rank runs NorMuon on its own shard, so the result "
                       "depends on the TP size), or tensor (and expert tensor) parallel size 1")
        return self._blocks(p, where)

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


class MegatronAdamW(_MegatronFlat):
    """This project's AdamW (docs/spec.md section 4) with the constructor of TE's FusedAdam / torch.optim.AdamW,
    for Megatron's Adam groups; what it does not implement is refused, with the reason (docs/megatron.md).
    Keyword-only extras: backend, threads, nonfinite, verdict (as MegatronNorMuon)."""

    _label = "MegatronAdamW"
    _algorithm = "adamw"
    _group_keys = {"beta1": "betas[0]", "beta2": "betas[1]", "lr": "lr", "eps": "eps",
                   "weight_decay": "weight_decay"}
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
        refused = [  # (keyword, its value, whether it is refused, why)
            ("amsgrad", amsgrad, amsgrad, "AMSGrad is not implemented"),
            ("capturable", capturable, capturable, "CUDA graph capture (--optimizer-cuda-graph) needs the CUDA "
                                                   "backend"),
            ("maximize", maximize, maximize, "only minimisation is implemented"),
            ("differentiable", differentiable, differentiable, "the step is not differentiable"),
            ("master_weights", master_weights, master_weights, precision),
            ("use_decoupled_grad", use_decoupled_grad, use_decoupled_grad, precision),
            ("store_param_remainders", store_param_remainders, store_param_remainders, precision),
            ("master_weight_dtype", master_weight_dtype, master_weight_dtype != torch.float32, precision),
            ("exp_avg_dtype", exp_avg_dtype, exp_avg_dtype != torch.float32, precision),
            ("exp_avg_sq_dtype", exp_avg_sq_dtype, exp_avg_sq_dtype != torch.float32, precision),
            ("adam_w_mode", adam_w_mode, adam_w_mode not in (True, 1),
             "only decoupled weight decay (AdamW, p <- p * (1 - lr * wd)) is implemented, not Adam's L2 decay "
             "added to the gradient (Megatron passes adam_w_mode=config.decoupled_weight_decay: keep it True)"),
            ("bias_correction", bias_correction, bias_correction not in (True, 1),
             "only bias-corrected AdamW is implemented")]
        for name, value, bad, why in refused:
            if bad:
                self._fail(f"{name}={value!r}: {why}")
        self.set_grad_none = set_grad_none  # only zero_grad()'s default; foreach and fused have no effect
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults, backend, threads, nonfinite, verdict, _device_backend)

    def _hypers(self, i, group):
        betas = group.get("betas")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            self._fail(f"param_groups[{i}]: betas={betas!r} is not a pair")
        if group.get("bias_correction", True) not in (True, 1):
            self._fail(f"param_groups[{i}]: bias_correction={group['bias_correction']!r}: only bias-corrected "
                       "AdamW is implemented")
        return super()._hypers(i, dict(group, **{"betas[0]": betas[0], "betas[1]": betas[1]}))

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
        return importlib.import_module("importlib.metadata").version("megatron-core")
    except Exception:  # noqa: BLE001 - not installed as a distribution, or no metadata
        return None


def check_version(version, allow_untested_version=False, caller="register"):
    """RuntimeError for a version outside KNOWN_GOOD_VERSIONS or unknown, unless allow_untested_version; the
    message names the caller (register, replace_adam)."""
    if allow_untested_version:
        return
    low, high = KNOWN_GOOD_VERSIONS
    known = f"{low[0]}.{low[1]} to {high[0]}.{high[1]}"
    match = re.match(r"\s*(\d+)\.(\d+)", version or "")
    if match is None:
        raise RuntimeError(f"normuon.megatron.{caller}: cannot tell the megatron-core version (found {version!r}); "
                           f"the adapter knows megatron-core {known}. Pass allow_untested_version=True to go on "
                           "anyway")
    found = (int(match.group(1)), int(match.group(2)))
    if not low <= found <= high:
        why = ("before 0.18 Megatron has no emerging-optimizer registry" if found < low else
               "newer than any release it was checked against")
        raise RuntimeError(f"normuon.megatron.{caller}: megatron-core {version} is outside the known-good range "
                           f"{known} ({why}). Pass allow_untested_version=True to go on anyway")


def _megatron(caller, allow_untested_version, registry=False, adam=False):
    """megatron.core.optimizer, its emerging_optimizers module and the version, once the version gate has
    passed and they have what the caller sets (registry, adam): RuntimeError otherwise, nothing touched."""
    try:
        mopt = importlib.import_module("megatron.core.optimizer")
        eo = importlib.import_module("megatron.core.optimizer.emerging_optimizers")
    except ImportError as error:
        raise RuntimeError(f"normuon.megatron.{caller}: megatron-core is not importable ({error})") from None
    version = megatron_core_version()
    check_version(version, allow_untested_version, caller)
    missing = [a for a in ("_EMERGING_OPTIMIZERS", "EmergingOptimizerEntry") if not hasattr(eo, a)]
    if registry and (missing or not isinstance(getattr(eo, "_EMERGING_OPTIMIZERS", None), dict)):
        raise RuntimeError(f"normuon.megatron.{caller}: megatron-core {version}: megatron.core.optimizer."
                           f"emerging_optimizers lacks {', '.join(missing) or 'a dict registry'} (the "
                           "emerging-optimizer registry this adapter plugs into)")
    missing = [a for a in ("Adam", "USING_PYTORCH_OPTIMIZER") if not hasattr(mopt, a)]
    if adam and missing:
        raise RuntimeError(f"normuon.megatron.{caller}: megatron-core {version}: megatron.core.optimizer lacks "
                           f"{', '.join(missing)} (the module globals replace_adam sets)")
    return mopt, eo, version


def _set_adam(mopt, backend, threads):
    """MegatronAdamW (with backend/threads as its defaults: Megatron passes neither) as Megatron's Adam, and
    USING_PYTORCH_OPTIMIZER off (without TE/Apex Megatron would otherwise call torch.optim.AdamW directly)."""
    cls = MegatronAdamW
    if backend is not None or threads:
        init = functools.partialmethod(MegatronAdamW.__init__, backend=backend, threads=threads)
        cls = type("MegatronAdamW", (MegatronAdamW,), {"__init__": init})
    mopt.Adam, mopt.USING_PYTORCH_OPTIMIZER = cls, False
    return cls


def replace_adam(*, allow_untested_version=False, backend=None, threads=0):
    """Makes Megatron build MegatronAdamW wherever it builds its Adam (module globals: Megatron has no Adam
    registry), with register()'s version gate and fail-closed checks. Returns the class."""
    mopt, _, _ = _megatron("replace_adam", allow_untested_version, adam=True)
    return _set_adam(mopt, backend, threads)


def register(name="normuon", *, replace_existing=False, replace_adam=False, allow_untested_version=False,
             backend=None, threads=0):
    """Adds MegatronNorMuon to Megatron's emerging-optimizer registry under `name` (routing copied from its muon
    entry) and returns the entry; replace_adam=True: MegatronAdamW for the Adam groups too. Fails closed, nothing
    touched (docs/megatron.md); taking over Megatron's own entry needs replace_existing=True. backend/threads go
    to every optimizer it builds."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"normuon.megatron.register: name={name!r} must be a non-empty string")
    mopt, eo, version = _megatron("register", allow_untested_version, registry=True, adam=replace_adam)
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
