"""normuon.megatron: NorMuon (and the AdamW half) for Megatron-LM (docs/megatron.md).

    import normuon.megatron
    normuon.megatron.register()          # once, before get_megatron_optimizer() / pretrain()
    config = OptimizerConfig(optimizer="normuon", muon_coefficient_type="simple", ...)

`MegatronNorMuon` is a torch optimizer whose constructor takes the keyword names of Megatron's own
`TensorParallelAdaptiveMuon`, so Megatron's existing `muon_*` / `adaptive_muon_*` config fields reach it
without new flags. It runs this project's NorMuon (docs/spec.md section 3) on the fast backend.
`MegatronAdamW` takes the keywords of TE's FusedAdam / torch.optim.AdamW and runs this project's AdamW
(spec section 4) with FusedAdam's step rule; `register(replace_adam=True)` makes Megatron build it for its
Adam groups. Both build their flat layout lazily and rebuild it whenever Megatron's wrappers change
`param_groups` (fp32 copies swapped in, 1-D shards, groups narrowed or emptied), and both emit
parameter-shaped checkpoint state, as Megatron's distributed checkpointing requires. Megatron is imported
only inside `register()`.
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
from .plan import plan_groups
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

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _group_size(group):
    """Ranks in a process group (None: 1); anything with size() works, so tests can pass stand-ins."""
    if group is None:
        return 1
    size = getattr(group, "size", None)
    if callable(size):
        return int(size())
    import torch.distributed as dist

    return int(dist.get_world_size(group))


def _number(label, where, group, key):
    """A group value as a float: a Python number or a one-element tensor (Megatron's scheduler may keep lr
    as a tensor and fill_() it). Its range is the core's to check (_checked)."""
    if key not in group:
        raise ValueError(f"{label}: {where} has no '{key}'")
    return _as_number(label, where, key, group[key])


def _as_number(label, where, key, value):
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{label}: {where}: {key} is a tensor of shape {tuple(value.shape)}, not a scalar")
        value = value.item()
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{label}: {where}: {key}={value!r} is not a number") from None


def _checked(label, where, algorithm, values, given, notes=None):
    """The spec's values checked by the core (check_values); a refusal names the group value it came from.
    given: {spec field: (the group's key, its value)}; notes: {spec field: what to add to a refusal}."""
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


def _tp_sharded(p):
    """Megatron's tensor-parallel metadata: the parameter is one rank's slice along partition_dim."""
    return bool(getattr(p, "tensor_model_parallel", False)) and getattr(p, "partition_dim", -1) not in (-1, None)


class _Slot:
    """One parameter of param_groups and its engine entries: the parameter itself (blocks is None), or its
    blocks of rows (a split QKV weight: RowBlocks, stepped in place)."""

    __slots__ = ("param", "entries", "blocks", "views", "lazy")

    def __init__(self, param, entries, blocks, views):
        self.param, self.entries, self.blocks, self.views = param, entries, blocks, views
        self.lazy = None  # the _SplitState installed in self.state for a split parameter


class _Tracked(dict):
    """self.state and its per-parameter dicts: dicts that note, in a flag they share, any change made through
    their methods (state moved, replaced, removed or added by Megatron's wrappers or torch's machinery), so
    that a step tells in O(1) that nothing changed and walks no parameter."""

    def __init__(self, changed, *args):
        super().__init__(*args)
        self.changed = changed  # [bool], shared by the mapping and its per-parameter dicts

    def _change(self):
        self.changed[0] = True

    def __missing__(self, key):  # defaultdict(dict), as torch's optimizers have it
        self._change()
        value = _Tracked(self.changed)
        dict.__setitem__(self, key, value)
        return value

    def __setitem__(self, key, value):
        self._change()
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self._change()
        super().__delitem__(key)

    def __reduce__(self):  # copies and pickles as the plain dict it stands for
        return dict, (dict(self),)

    def _changes(name):
        def method(self, *args, **kwargs):
            self._change()
            return getattr(dict, name)(self, *args, **kwargs)
        method.__name__ = name
        return method

    pop, popitem, clear, update, setdefault, __ior__ = map(_changes, ("pop", "popitem", "clear", "update",
                                                                        "setdefault", "__ior__"))
    del _changes


class _SplitState(MutableMapping):
    """self.state[p] of a parameter split into row blocks: parameter-shaped fp32 copies of its blocks' state,
    assembled on first access. A step reads and writes the blocks where they lie and needs no copy, so
    while nobody looks, none is made; once looked at, every step reads the copies back first (edits in
    place and replaced entries are honoured) and installs a fresh one after. It copies, pickles and
    deep-copies as the plain dict it stands for (not a dict itself: isinstance(state, dict) is False).
    `assemble` must not refer to the optimizer (no reference cycle keeps it alive)."""

    def __init__(self, assemble):
        self._assemble, self._data = assemble, None

    @property
    def touched(self):
        return self._data is not None

    def _values(self):
        if self._data is None:
            self._data = self._assemble()
        return self._data

    def __getitem__(self, key):
        return self._values()[key]

    def __setitem__(self, key, value):
        self._values()[key] = value

    def __delitem__(self, key):
        del self._values()[key]

    def __iter__(self):
        return iter(self._values())

    def __len__(self):
        return len(self._values())

    def __repr__(self):
        return f"_SplitState({self._values()!r})"

    def copy(self):
        return dict(self._values())

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return copy.deepcopy(self._values(), memo)

    def __reduce__(self):  # pickle, torch.save: the plain dict
        return dict, (self.copy(),)


def _assemble(entries, blocks, export, master):
    """A parameter's state, parameter-shaped fresh fp32 copies (and master_param, for a bf16/f16
    parameter, with master): from its one entry, or put together from its blocks' (in the parameter's
    shape when the blocks were made)."""
    parts = [export(e, master) for e in entries]
    if blocks is None:
        return parts[0]
    out = {}
    for key in parts[0]:
        full = torch.empty(blocks[0].param_shape, dtype=torch.float32, device=parts[0][key].device)
        for part, block in zip(parts, blocks):
            block.write(full, part[key])
        out[key] = full
    return out


class _MegatronFlat(NotCopyable, torch.optim.Optimizer):
    """What MegatronNorMuon and MegatronAdamW share: the engine (engine.py, as NorMuonAdamW's; one
    algorithm) over the parameters param_groups holds now, built lazily and again when they change; the
    Megatron-facing state (self.state, state dicts) translated to and from its buffers; TE FusedAdam's step
    rule.

    Subclasses set _label, _algorithm, _state_keys and implement _check_param, _spec_defaults, _hypers,
    _memory_views, _entry_writes and _entry_export (and _blocks for parameters split into row blocks)."""

    _label = None
    _algorithm = None
    _state_keys = ()

    def _setup(self, backend, threads, nonfinite, verdict, device_backend=None):
        """Before torch's __init__ (which calls add_param_group). device_backend: NorMuonAdamW's
        _device_backend (the tests' emulated CUDA engine)."""
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
        self._group_map = []    # (index in param_groups, index of the engine's group)
        self._advanced = []     # groups whose step the last step() advanced (taken back if it was skipped)
        self._settled_reason = None  # why the previous step was skipped, learnt when it was settled
        self.last_skip_reason = None

    def _fail(self, message):
        raise ValueError(f"{self._label}: {message}")

    def _check_all(self):
        for i, g in enumerate(self.param_groups):
            for k, p in enumerate(g["params"]):
                self._check_param(p, f"param_groups[{i}]['params'][{k}]")

    def _check_common(self, p, where):
        if p.device.type not in ("cpu", "cuda"):
            self._fail(f"{where} is on {p.device}: normuon runs on CPU or CUDA tensors")
        if p.dtype not in _DTYPES:
            self._fail(f"{where} is {p.dtype}; float32, bfloat16 or float16 expected")
        if p.is_sparse:
            self._fail(f"{where} is sparse")

    def _blocks(self, p, where):
        """None, or the RowBlocks that the engine steps as matrices of their own."""
        return None

    # --------------------------------------------------------------------------- the flat layout

    def _current_signature(self):
        """Which tensors param_groups holds (Megatron swaps the tensor objects); a bound tensor whose shape,
        dtype or device changed in place is refused by the engine's step, by name."""
        return tuple(tuple(map(id, g["params"])) for g in self.param_groups)

    def _ensure_built(self):
        """The layout matches param_groups, and self.state holds this optimizer's views (after a rebuild,
        or values someone else put into self.state, copied in)."""
        if self.engine is not None:
            self._settle()  # the previous step's deferred verdict, before its counters or state are read
        signature = self._current_signature()
        if signature != self._signature:
            self._rebuild(signature)
        else:
            self._adopt_state()

    def _rebuild(self, signature):
        """A new engine over the parameters param_groups holds now (the re-layout path NorMuonAdamW's
        add_param_group takes too: Engine.carry_from). State comes from self.state (moved there by
        Megatron's wrappers, or our views of the previous layout), fp32 masters from the previous layout;
        parameters that left the groups lose theirs."""
        present = []
        for i, g in enumerate(self.param_groups):
            params = list(g["params"])
            for k, p in enumerate(params):
                self._check_param(p, f"param_groups[{i}]['params'][{k}]")
            if params:
                present.append((i, params))
        engine, slots, group_map = None, {}, []
        if present:
            groups, plan, all_blocks = [], [], {}
            for i, params in present:
                tensors, names = [], []
                for k, p in enumerate(params):
                    blocks = self._blocks(p, f"param_groups[{i}]['params'][{k}]")
                    if blocks is None:
                        keys, labels = [p], [f"g{i}.p{k}"]
                    else:  # each block stepped where it lies in the parameter, as a matrix of its own
                        keys = [b.key for b in blocks]
                        labels = [f"g{i}.p{k}.b{j}" for j in range(len(blocks))]
                        all_blocks.update((id(b.key), b) for b in blocks)
                    plan.append((p, keys, blocks))
                    tensors += keys
                    names += labels
                groups.append(dict(params=tensors, names=names, name=f"g{i}", algorithm=self._algorithm))
            # The spec's values stand in until step() hands over the groups' own (Megatron builds with
            # lr=None and lets its scheduler set it); the fixed ones (layout, plan) are final.
            values = _native.check_values("defaults", self._algorithm, self._spec_defaults())
            aw = _native.defaults("adamw")
            adamw = dict(lr=aw["lr"], betas=(aw["beta1"], aw["beta2"]), eps=aw["eps"], weight_decay=aw["weight_decay"])
            try:  # the planned groups' values are not used: values are
                planned, entries = plan_groups(groups, _native.defaults("normuon"), adamw, {}, {}, all_blocks)
                engine = Engine(entries, [(g["name"], self._algorithm, values) for g in planned], self._choice,
                                threads=self._threads, nonfinite=self.nonfinite, verdict=self.verdict,
                                row_blocks=bool(all_blocks), device_backend=self._device_backend)
            except ValueError as error:
                raise ValueError(f"{self._label}: {error} (gI.pK is param_groups[I]['params'][K])") from None
            by_key = {id(e.tensor): e for e in engine.entries}
            group_map = [(i, j) for j, (i, _) in enumerate(present)]
            for p, keys, blocks in plan:
                found = [by_key[id(t)] for t in keys]
                slots[id(p)] = _Slot(p, found, blocks, self._memory_views(found[0]) if blocks is None else None)
        # The values: check everything first, then write (the previous views stay valid until then).
        writes, where = [], self._positions()
        for slot in slots.values():
            writes += self._slot_writes(slot, self.state.get(slot.param) or {}, f"state of {where[id(slot.param)]}")
        if engine is not None and self.engine is not None:
            steps = [_step_value(self._label, self.param_groups[i].get("step", 0), f"param_groups[{i}]")
                     for i, _ in group_map]
            engine.carry_from(self.engine, steps)  # the masters' low bits (the state: below)
        for dst, src in writes:
            dst.copy_(src)
        self.engine, self._slots, self._group_map, self._signature = engine, slots, group_map, signature
        self._install_state()

    def _install_state(self):
        """self.state from the engine's buffers: live views for parameters it steps whole, parameter-shaped
        copies for split ones, assembled when first looked at (_SplitState)."""
        changed = [False]
        self.state = _Tracked(changed, ((slot.param, _Tracked(changed, slot.views) if slot.blocks is None
                                         else self._split_state(slot)) for slot in self._slots.values()))
        self._split_slots = [slot for slot in self._slots.values() if slot.blocks is not None]

    def _split_state(self, slot):
        # _entry_export is a static method: the partial holds no reference to this optimizer.
        slot.lazy = _SplitState(functools.partial(_assemble, slot.entries, slot.blocks, self._entry_export, False))
        return slot.lazy

    def _refresh_split_state(self):
        """After a step: a split parameter's copies, if anyone looked at them or put others in their place,
        are stale now; a fresh, not yet assembled mapping takes their place."""
        for slot in self._split_slots:
            current = self.state.get(slot.param)
            if current is not slot.lazy or slot.lazy.touched:
                dict.__setitem__(self.state, slot.param, self._split_state(slot))  # ours: not a change to adopt

    def _adopt_state(self):
        """Someone replaced, removed, added or (for split parameters) looked at entries of self.state (a load
        through torch's machinery, offload/restore, a wrapper moving state): copy their values into the flat
        state, reinstall the views."""
        if isinstance(self.state, _Tracked) and not self.state.changed[0] and \
                not any(slot.lazy.touched for slot in self._split_slots):
            return  # nothing changed: no parameter walked
        stale = []
        for slot in self._slots.values():
            current = self.state.get(slot.param)
            if slot.blocks is not None:  # its copies, once assembled, may have been edited: read them back
                if current is not slot.lazy or slot.lazy.touched:
                    stale.append(slot)
            elif not current or any(current.get(k) is not v for k, v in slot.views.items()):
                stale.append(slot)
        if not stale and len(self.state) == len(self._slots):
            if isinstance(self.state, _Tracked):
                self.state.changed[0] = False
            return
        writes, where = [], self._positions()
        for slot in stale:
            writes += self._slot_writes(slot, self.state.get(slot.param) or {},
                                        f"state of {where.get(id(slot.param), 'a parameter')}")
        for dst, src in writes:
            dst.copy_(src)
        # Views again where they were replaced; a split parameter's copies stay where they are (a handle
        # someone holds keeps counting until the next step refreshes them).
        changed = [False]
        state = _Tracked(changed)
        for slot in self._slots.values():
            kept = self.state.get(slot.param)
            if slot.blocks is None:
                dict.__setitem__(state, slot.param, _Tracked(changed, slot.views))
            else:
                ours = kept is slot.lazy  # (len() would assemble it)
                dict.__setitem__(state, slot.param, kept if ours or (kept is not None and len(kept))
                                 else self._split_state(slot))
        self.state = state

    def _positions(self):
        """id(param) -> where it sits in param_groups, for messages."""
        return {id(p): f"param_groups[{i}]['params'][{k}]"
                for i, g in enumerate(self.param_groups) for k, p in enumerate(g["params"])}

    def _slot_writes(self, slot, saved, where):
        """(destination, source) pairs that put `saved` (one parameter's state dict, parameter-shaped or in
        the in-memory form) into the flat state; empty means fresh state (zeros). ValueError, before anything
        is written, if it does not fit."""
        if not saved:
            return [(t, torch.zeros(())) for e in slot.entries for t in e.state]
        loadable = set(self._state_keys) | {"master_param", "step"}
        unknown = sorted(set(saved) - loadable)
        missing = [k for k in self._state_keys if k not in saved]
        if unknown or missing:
            self._fail(f"{where} has keys {sorted(saved)}; expected {' and '.join(self._state_keys)} "
                       "(optionally master_param, step)")
        for key, src in saved.items():
            if key != "step" and (not isinstance(src, torch.Tensor) or not src.is_floating_point()):
                got = src.dtype if isinstance(src, torch.Tensor) else type(src).__name__
                self._fail(f"{where}: {key} is {got}, not a floating-point tensor")
        if slot.blocks is None:
            return self._entry_writes(slot.entries[0], saved, where)
        shape = tuple(slot.param.shape)
        for key, src in saved.items():
            if key != "step" and tuple(src.shape) != shape:
                self._fail(f"{where}: {key} has shape {tuple(src.shape)}, expected {shape} (the state of a "
                           "parameter split into QKV blocks is parameter-shaped)")
        writes = []
        for j, (e, block) in enumerate(zip(slot.entries, slot.blocks)):
            part = {k: block.values(v) for k, v in saved.items() if k != "step"}
            writes += self._entry_writes(e, part, f"{where} (block {j})")
        return writes

    def _assemble(self, slot, master):
        """_assemble for one slot (no reference to this optimizer: see _SplitState)."""
        return _assemble(slot.entries, slot.blocks, self._entry_export, master)

    # ------------------------------------------------------------------------------- Megatron hooks

    def _init_group(self, group, skip_non_grad_params=True):
        """Megatron's init_state_fn calls this for every group (skip_non_grad_params=False) before it loads
        a checkpoint. State lives in the flat layout, so every parameter of every group has it once the
        layout is built; the arguments only follow Emerging-Optimizers' signature."""
        self._ensure_built()

    # ------------------------------------------------------------------------------------- the step

    @torch.no_grad()
    def step(self, closure=None):
        """One step over every parameter with a gradient (others are left as they are), then
        group['step'] += 1 in every group with parameters. Hyper-parameters are read (and checked) first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._settled_reason = None
        self._ensure_built()  # settles the previous step first (verdict='deferred')
        values = [self._hypers(i, self.param_groups[i]) for i, _ in self._group_map]  # checked, in engine order
        steps = [_step_value(self._label, self.param_groups[i].get("step", 0), f"param_groups[{i}]")
                 for i, _ in self._group_map]
        skipped = None
        if self.engine is not None:
            self.engine.set_nonfinite(self.nonfinite)
            self.engine.set_values(values)
            # TE FusedAdam's rule: the step about to run is group['step'] + 1 (AdamW's bias correction reads
            # it); the core would count only steps with a gradient in the group.
            self.engine.set_steps(steps)  # every parameter at its group's counter (TE)
            skipped = self.engine.step()
            self._refresh_split_state()
        # Deferred: this step's own verdict comes at the next one; what is reported now is the previous
        # step's, as NorMuonAdamW reports it.
        self.last_skip_reason = skipped if skipped is not None else self._settled_reason
        if skipped is None:
            self._advanced = [i for i, g in enumerate(self.param_groups) if len(g["params"]) > 0]
            for i in self._advanced:
                g = self.param_groups[i]
                g["step"] = _step_value(self._label, g.get("step", 0), "a param group") + 1
        return loss

    def _settle(self):
        """verdict='deferred' on CUDA: the previous step's NaN/Inf verdict, taken from a status copy that step
        already made (no device sync). A skipped step changed nothing on the device, so the counters step()
        advanced for it go back; nonfinite='error' raises here, one step late."""
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
                g = self.param_groups[i]
                g["step"] = max(0, _step_value(self._label, g.get("step", 0), "a param group") - 1)
        self._advanced = []

    @property
    def backend(self):
        """'fast-cpu', 'fast-cuda' or 'reference-python' once built; before that the choice ('auto' | 'fast' | 'reference')."""
        return self.engine.backend if self.engine is not None else self._choice

    # ------------------------------------------------------------------------------- state dicts

    def _extra_export(self, group):
        """Per-parameter entries besides the state tensors (MegatronAdamW: a per-parameter step)."""
        return {}

    def state_dict(self):
        """torch's structure, every tensor parameter-shaped (Megatron's distributed checkpoint requires it)
        and a fresh fp32 copy, plus master_param for a bf16/f16 parameter. Before the first step (nothing
        built, no state) "state" is empty, as torch's."""
        if self.engine is not None or any(self.state.values()):
            self._ensure_built()
        groups, state, index = [], {}, 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(index, index + len(g["params"])))
            for p in g["params"]:
                slot = self._slots.get(id(p))
                if slot is not None:
                    state[index] = dict(self._assemble(slot, master=True), **self._extra_export(g))
                index += 1
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Loads a state dict of the same groups and parameter counts; per parameter the forms _entry_writes
        accepts. A group without 'step' takes a per-parameter 'step' if all agree (its value is read, the
        tensor is never kept). Everything is checked before anything is written; a parameter without saved
        state gets fresh (zero) state."""
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
    """NorMuon (docs/spec.md section 3) with the constructor of Megatron's TensorParallelAdaptiveMuon.

    The keyword arguments are Megatron's (see CONFIG_FIELDS for the config fields they come from); each
    maps onto the spec as docs/megatron.md tabulates. Values the adapter cannot run are rejected here, with
    the reason: moment2_method other than 'normuon', L2 weight decay, coefficient types other than 'simple',
    and a tensor-parallel shard (TP > 1) under tp_mode 'duplicated' or 'distributed'. With split_qkv, a QKV
    weight (is_qkv_fn(p)) is cut into its Q, K and V row blocks (p.qkv_split_shapes, else qkv_split_shapes,
    per query group, as Megatron does) and each block is run as a matrix of its own. Under tp_mode
    'blockwise' each rank's shard is run as a matrix of its own. Accepted without effect: use_syrk (a CUDA
    kernel choice).

    Per group, every step reads lr (a float or a one-element tensor), weight_decay, momentum, beta2 and
    eps, so Megatron's scheduler works. group['step'] is a Python int incremented once per step() in every
    group that has parameters, whether or not they have gradients (TE FusedAdam's rule, which Megatron's
    step synchronisation across optimizers relies on).

    Keyword-only extras: backend ('auto' | 'fast' | 'reference'; None reads NORMUON_BACKEND, then 'auto',
    which is the fast backend), threads (fast backend; 0 = one per processor this process may use, within its CPU quota), nonfinite ('error' |
    'skip_step'), verdict ('deferred', the default: on CUDA a step's NaN/Inf verdict is read at the next
    step, so no host sync; 'sync': in the same step).
    """

    _label = "MegatronNorMuon"
    _algorithm = "normuon"
    _state_keys = ("momentum_buffer", "moment2_buffer")

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
        self._setup(backend, threads, nonfinite, verdict, _device_backend)
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
        self.nesterov = self._fixed["nesterov"]
        # The spec has no free scale factor; an extra constant is folded into the learning rate and out of
        # the weight decay: p(1 - lr*wd) - lr*k*U  ==  p(1 - (k*lr)(wd/k)) - (k*lr)*U  (exact up to rounding).
        self._fold = c * extra
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, beta2=beta2, eps=eps)
        super().__init__(params, defaults)
        self._check_all()

    # ------------------------------------------------------------------------------------- checks

    def _tp_size(self, p):
        """Ranks the parameter is sharded over: Megatron's expert TP group for expert weights, else TP."""
        if self.pg_collection is None:
            return 1
        attr = "expt_tp" if getattr(p, "expert_tp", False) else "tp"
        return _group_size(getattr(self.pg_collection, attr, None))

    def _check_param(self, p, where):
        if p.dim() != 2:
            self._fail(f"{where} has shape {list(p.shape)}: NorMuon needs whole 2-D matrices. Megatron routes "
                       "non-matrix parameters to Adam; under --use-distributed-optimizer the emerging-optimizer "
                       "path shards whole matrices per rank (LayerWise), never 1-D fragments")
        self._check_common(p, where)
        size = self._tp_size(p) if _tp_sharded(p) else 1
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
        gate block too when attention_output_gate is on); block j gathers its rows of every query group,
        and each block is orthogonalised, normalised and scaled as a matrix of its own."""
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

    def _spec_defaults(self):
        return dict(self._fixed)

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

    # ------------------------------------------------------------------------------- state forms

    @staticmethod
    def _memory_views(e):
        """Emerging-Optimizers' in-memory forms: momentum m x n, moment2 [m, 1] or [1, n] (live views)."""
        m, n = e.shape
        return {"momentum_buffer": e.state[0], "moment2_buffer": e.state[1].view((m, 1) if e.stats_per_row else (1, n))}

    def _entry_writes(self, e, saved, where):
        """moment2_buffer may be parameter-shaped (constant along the statistics axis), reduced, or [m, 1] /
        [1, n]; momentum_buffer and master_param are parameter-shaped."""
        shape = tuple(e.shape)
        writes = []
        for key in ("momentum_buffer", "moment2_buffer", "master_param"):
            src = saved.get(key)
            if src is None:
                continue
            if key == "moment2_buffer":
                writes.append((e.state[1], _reduce_moment2(src, shape, e.stats_per_row, where)))
            elif tuple(src.shape) != shape:
                self._fail(f"{where}: {key} has shape {tuple(src.shape)}, expected {shape}")
            elif key == "momentum_buffer":
                writes.append((e.state[0], src))
            elif e.low_precision:  # master_param: the fp32 master of a bf16/f16 parameter
                writes.append((e.param, src))
        return writes

    @staticmethod
    def _entry_export(e, master):
        s = {"momentum_buffer": e.state[0].clone(),
             "moment2_buffer": (e.state[1].view(-1, 1) if e.stats_per_row else e.state[1].view(1, -1))
             .expand(e.shape).clone(memory_format=torch.contiguous_format)}
        if master and e.low_precision:
            s["master_param"] = e.param.clone()
        return s


class MegatronAdamW(_MegatronFlat):
    """This project's AdamW (docs/spec.md section 4, the code path of NorMuonAdamW's AdamW groups) with the
    constructor of TE's FusedAdam / torch.optim.AdamW, for Megatron's Adam groups (register(replace_adam=True)).

    lr, betas, eps, weight_decay and bias_correction are group values, read at every step (lr may be a
    one-element tensor; MuP's per-group eps works). Refused, with the reason: amsgrad, adam_w_mode=False (L2
    Adam), bias_correction=False, capturable, maximize, differentiable, and TE's precision-aware options
    (master_weights, non-fp32 state dtypes, use_decoupled_grad, store_param_remainders): Megatron keeps the
    fp32 master weights itself. Accepted without effect: foreach, fused, set_grad_none (only zero_grad's
    default).

    Step rule (TE FusedAdam): group['step'] is a Python int incremented once per step() in every group that
    has parameters, with or without gradients, and the bias correction of step t uses it; there is no
    per-parameter step tensor in self.state. state_dict() adds a per-parameter 'step' (a fresh 0-d fp32
    tensor equal to the group's), which torch's and Megatron's no-TE paths read; load_state_dict() takes the
    group's 'step', else a common per-parameter one, reading its value and never keeping the tensor (a
    loaded step tensor may be shared by every parameter).

    Keyword-only extras: backend, threads, nonfinite, verdict (as MegatronNorMuon).
    """

    _label = "MegatronAdamW"
    _algorithm = "adamw"
    _state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 bias_correction=True, adam_w_mode=True, capturable=False, master_weights=False,
                 master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 use_decoupled_grad=False, store_param_remainders=False, set_grad_none=None, maximize=False,
                 foreach=None, fused=None, differentiable=False, backend=None, threads=0, nonfinite="error",
                 verdict="deferred", _device_backend=None):
        precision = ("master_weights, exp_avg_dtype, exp_avg_sq_dtype, use_decoupled_grad and "
                     "store_param_remainders are TE's precision-aware options (--use-precision-aware-optimizer), "
                     "which this optimizer does not implement: Megatron keeps fp32 master weights and state")
        for name, value, default in (("amsgrad", amsgrad, False), ("capturable", capturable, False),
                                     ("maximize", maximize, False), ("differentiable", differentiable, False),
                                     ("master_weights", master_weights, False),
                                     ("use_decoupled_grad", use_decoupled_grad, False),
                                     ("store_param_remainders", store_param_remainders, False)):
            if bool(value) != default:
                why = {"amsgrad": "AMSGrad is not implemented",
                       "capturable": "CUDA graph capture (--optimizer-cuda-graph) needs the CUDA backend",
                       "maximize": "only minimisation is implemented",
                       "differentiable": "the step is not differentiable"}.get(name, precision)
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
        self._setup(backend, threads, nonfinite, verdict, _device_backend)
        self.set_grad_none = set_grad_none
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults)
        self._check_all()

    def _check_param(self, p, where):
        self._check_common(p, where)  # any shape: DistOpt hands over 1-D shards, some empty

    def _spec_defaults(self):
        return _native.defaults("adamw")

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

    @staticmethod
    def _memory_views(e):
        return {"exp_avg": e.state[0], "exp_avg_sq": e.state[1]}

    def _entry_writes(self, e, saved, where):
        shape = tuple(e.shape)
        writes = []
        for key, dst in (("exp_avg", e.state[0]), ("exp_avg_sq", e.state[1]), ("master_param", e.param)):
            src = saved.get(key)
            if src is None:
                continue
            if tuple(src.shape) != shape:
                self._fail(f"{where}: {key} has shape {tuple(src.shape)}, expected {shape}")
            if key != "master_param" or e.low_precision:
                writes.append((dst, src))
        return writes

    @staticmethod
    def _entry_export(e, master):
        s = {"exp_avg": e.state[0].clone(), "exp_avg_sq": e.state[1].clone()}
        if master and e.low_precision:
            s["master_param"] = e.param.clone()
        return s

    def _extra_export(self, group):
        # A fresh tensor per parameter: whoever loads it may share or increment it, never ours.
        return {"step": torch.tensor(float(_step_value(self._label, group.get("step", 0), "a param group")))}

    def zero_grad(self, set_to_none=None):
        """TE FusedAdam's default: gradients set to None (or set_grad_none's value when given)."""
        if set_to_none is None:
            set_to_none = True if self.set_grad_none is None else bool(self.set_grad_none)
        super().zero_grad(set_to_none=set_to_none)


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


def _import_megatron(caller):
    try:
        return (importlib.import_module("megatron.core.optimizer"),
                importlib.import_module("megatron.core.optimizer.emerging_optimizers"))
    except ImportError as error:
        raise RuntimeError(f"normuon.megatron.{caller}: megatron-core is not importable ({error})") from None


def _with_defaults(cls, backend, threads):
    """cls, or a subclass whose backend/threads default to the given ones (Megatron passes neither)."""
    if backend is None and not threads:
        return cls

    class Bound(cls):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("backend", backend)
            kwargs.setdefault("threads", threads)
            super().__init__(*args, **kwargs)

    Bound.__name__ = Bound.__qualname__ = cls.__name__
    return Bound


def _check_adam_hooks(mopt, version):
    missing = [a for a in ("Adam", "USING_PYTORCH_OPTIMIZER") if not hasattr(mopt, a)]
    if missing:
        raise RuntimeError(f"normuon.megatron: megatron-core {version}: megatron.core.optimizer lacks "
                           f"{', '.join(missing)} (the module globals replace_adam sets)")


def replace_adam(*, allow_untested_version=False, backend=None, threads=0):
    """Makes Megatron build MegatronAdamW wherever it builds its Adam (the Adam groups next to Muon, and
    --optimizer adam): sets megatron.core.optimizer.Adam and USING_PYTORCH_OPTIMIZER = False (without
    TE/Apex Megatron would otherwise call torch.optim.AdamW directly). Megatron has no Adam registry, so this
    patches module globals; the version gate and fail-closed checks are register()'s. Returns the class."""
    mopt, _ = _import_megatron("replace_adam")
    version = megatron_core_version()
    check_version(version, allow_untested_version)
    _check_adam_hooks(mopt, version)
    cls = _with_defaults(MegatronAdamW, backend, threads)
    mopt.Adam = cls
    mopt.USING_PYTORCH_OPTIMIZER = False
    return cls


def register(name="normuon", *, replace_existing=False, replace_adam=False, allow_untested_version=False,
             backend=None, threads=0):
    """Adds MegatronNorMuon to Megatron's emerging-optimizer registry under `name`, so that
    OptimizerConfig(optimizer=name) (or --optimizer name, for a name argparse accepts) builds it.

    Touches only megatron.core.optimizer.emerging_optimizers._EMERGING_OPTIMIZERS[name] (a new
    EmergingOptimizerEntry) and, where it exists, megatron.core.optimizer.HAVE_EMERGING_OPTIMIZERS (set True,
    because the emerging path refuses to run without Emerging-Optimizers, which this optimizer does not
    need). Parameter routing (which parameters go to Adam) is copied from Megatron's own muon entry. With
    replace_adam=True, Megatron's Adam groups get MegatronAdamW too (see replace_adam()).

    Fails closed with RuntimeError when megatron-core is missing, of a version outside KNOWN_GOOD_VERSIONS
    (unless allow_untested_version) or without the registry (or, with replace_adam, without the Adam
    globals); nothing is touched then. Replacing an entry Megatron already has (e.g. name='adaptive_muon',
    to keep the stock --optimizer choice) needs replace_existing=True. backend/threads are handed to every
    optimizer it builds. Returns the entry."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"normuon.megatron.register: name={name!r} must be a non-empty string")
    mopt, eo = _import_megatron("register")
    version = megatron_core_version()
    check_version(version, allow_untested_version)
    missing = [a for a in ("_EMERGING_OPTIMIZERS", "EmergingOptimizerEntry") if not hasattr(eo, a)]
    if missing or not isinstance(getattr(eo, "_EMERGING_OPTIMIZERS", None), dict):
        raise RuntimeError(f"normuon.megatron.register: megatron-core {version}: "
                           f"megatron.core.optimizer.emerging_optimizers lacks {', '.join(missing) or 'a dict registry'} "
                           "(the emerging-optimizer registry this adapter plugs into)")
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
        mopt.HAVE_EMERGING_OPTIMIZERS = True
    if replace_adam:
        mopt.Adam = _with_defaults(MegatronAdamW, backend, threads)
        mopt.USING_PYTORCH_OPTIMIZER = False
    return entry


def adamw_init_state_fn(opt, config=None):
    """Megatron's Adam init_state_fn contract for MegatronAdamW: state for every parameter. (Megatron's own
    init_state_fn, which puts zero tensors into opt.state, works too: they are adopted at the next step.)"""
    init_state_fn(opt, config)


__all__ = ["MegatronNorMuon", "MegatronAdamW", "register", "replace_adam", "init_state_fn", "adamw_init_state_fn",
           "config_to_kwargs", "check_scalar_routing", "ns_precision_for", "check_version", "megatron_core_version",
           "KNOWN_GOOD_VERSIONS", "CONFIG_FIELDS"]
