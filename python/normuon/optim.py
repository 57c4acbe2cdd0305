"""NorMuonAdamW: the NorMuon + AdamW hybrid (docs/spec.md) as a torch.optim.Optimizer.

A client of the native engine (normuon._C.Engine, core/include/normuon/engine.h): it plans the groups
(plan.py), hands the engine the model's tensors, and makes one native call per step. The engine holds
the layout, the checked values, the state and every counter, on the CPU or on a CUDA device; the
optimizer's state tensors are zero-copy views of its buffers.
"""
import contextlib
import math
import os
import warnings
import weakref
from collections import defaultdict

import torch

from . import reference
from .native import (_C, StateFileError, check_values, cuda_module, cuda_unavailable_reason, defaults,  # noqa: F401
                     native_error, require)
from .plan import (ADAMW_KEYS, ADAMW_PREFIXED, DTYPES, NORMUON_FIELDS, _normuon_betas, plan_groups,  # noqa: F401
                   resolve_inputs, route)
from .routing import infer_role, output_layer_doubts, routing_text, strip_wrappers, vocabulary_lookalikes  # noqa: F401

NORMUON_KNOBS = NORMUON_FIELDS[6:]  # everything after lr .. ns_steps

class NotCopyable:
    """The optimizers of this package refuse pickling and copying with a TypeError: a copy would share or
    lose the native buffers and the bindings to the model's tensors, and step wrongly."""

    def _refuse(self):
        raise TypeError(f"{type(self).__name__} cannot be pickled or copied: its state lives in native buffers "
                        "bound to the model's own tensors. Save opt.state_dict() (torch.save) or "
                        "opt.export_state(path), and build a new optimizer over the new model, then load it")

    def __reduce_ex__(self, protocol):
        self._refuse()

    def __copy__(self):
        self._refuse()

    def __deepcopy__(self, memo):
        self._refuse()


class NorMuonAdamW(NotCopyable, torch.optim.Optimizer):
    """NorMuon on 2-D hidden matrices, AdamW on everything else (docs/spec.md, docs/python.md).

    params: the model (recommended: its modules tell the embeddings and the head, routing.py),
        model.named_parameters(), plain tensors, or param groups: dicts with "params" (tensors or (name,
        tensor) pairs), optional "names", "name", "algorithm" ("auto" | "normuon" | "adamw") and
        hyper-parameters. An "auto" group (the default) is split by the routing rule into a NorMuon and an
        AdamW group; it takes NorMuon keys plus adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay.
    normuon_params, adamw_params: instead of params, an explicit split (one group each).
    model: beside params, the module they come from: bare tensors get its names and its modules' roles.
    lr, beta1 (alias momentum), beta2, weight_decay, nesterov, ns_steps, **knobs: NorMuon defaults
        (knobs: ns_coefficients, ns_precision, reduce_axis, lr_scale, weight_decay_mode, eps_placement,
        ns_eps, denom_eps, renorm_eps).
    adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW defaults.
    overrides: {name: "normuon" | "adamw" | "auto"}, wins over the rule. roles: {name: role}.
    backend: "auto" | "fast" | "reference"; None reads NORMUON_BACKEND, then "auto" (= fast). No fallback.
    threads: the fast backend's threads; None (the default) follows torch.get_num_threads(), 0: one per
        processor the process may use, within its CPU quota.
        nonfinite: "error" | "skip_step".
    verdict: on CUDA, when a step's NaN/Inf verdict reaches the host: "sync" (in step(), one host sync) or
        "deferred" (at the next step(), no sync; a bad step changes nothing on the device either way).
    _device_backend: (tests) a device backend from another native module (normuon_emulated's, the CUDA
        engine on the SIMT emulator), driving the parameters where they are.

    The step reads the gradients and writes the parameters in place (table mode): no copy of an fp32
    model; a bf16/fp16 parameter gets an fp32 master, written back rounded in the same pass.
    """

    # torch's GradScaler hands the step its scale and found_inf instead of unscaling the gradients in a pass
    # of its own (_scaler).
    _step_supports_amp_scaling = True

    def __init__(self, params=None, lr=None, beta1=None, beta2=None, weight_decay=None, nesterov=None, ns_steps=None,
                 *, momentum=None, adamw_lr=None, adamw_betas=None, adamw_eps=None, adamw_weight_decay=None,
                 normuon_params=None, adamw_params=None, model=None, overrides=None, roles=None, backend=None,
                 threads=None, nonfinite="error", verdict="sync", _row_blocks=(), _state_for_frozen=False,
                 _device_backend=None, **knobs):
        require("NorMuonAdamW")
        knobs = _torch_keywords(knobs)
        unknown = sorted(set(knobs) - set(NORMUON_KNOBS))
        if unknown:
            raise TypeError(f"NorMuonAdamW got unexpected keyword argument(s) {', '.join(unknown)} "
                            f"(NorMuon knobs: {', '.join(NORMUON_KNOBS)})")
        if momentum is not None:
            if beta1 not in (None, momentum):
                raise ValueError(f"momentum={momentum} and beta1={beta1} disagree (momentum is an alias of beta1)")
            beta1 = momentum
        # None: the core's default (options.h), the one place defaults are written.
        given = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, nesterov=nesterov, ns_steps=ns_steps)
        normuon_defaults = dict(defaults("normuon"), **{k: v for k, v in given.items() if v is not None}, **knobs)
        aw = defaults("adamw")
        adamw_defaults = dict(lr=aw["lr"] if adamw_lr is None else adamw_lr,
                              betas=(aw["beta1"], aw["beta2"]) if adamw_betas is None else tuple(adamw_betas),
                              eps=aw["eps"] if adamw_eps is None else adamw_eps,
                              weight_decay=aw["weight_decay"] if adamw_weight_decay is None else adamw_weight_decay)
        if nonfinite not in ("error", "skip_step"):
            raise ValueError(f"nonfinite={nonfinite!r}: choose error | skip_step")
        if verdict not in ("sync", "deferred"):
            raise ValueError(f"verdict={verdict!r}: choose sync | deferred")
        self.nonfinite = nonfinite
        self.verdict = verdict
        self._device_backend = _device_backend
        # Frozen parameters (requires_grad=False, no gradient) get no state until they have a gradient.
        # The wrappers hand over tensors that are no autograd leaves (Megatron's main parameters, a rank's
        # shards): they lay out everything.
        self._state_for_frozen = _state_for_frozen
        # The Megatron adapter's split QKV: RowBlocks, each standing in the groups as its key tensor.
        self._row_blocks = {id(b.key): b for b in _row_blocks}
        overrides = dict(overrides or {})
        params, roles = resolve_inputs(params, normuon_params, adamw_params, model, roles)
        # What add_param_group needs later: the constructor's values for a new group, and the model to name
        # and route its tensors (a weak reference: the optimizer must not keep a model alive).
        self._defaults_by_algorithm = (normuon_defaults, adamw_defaults)
        self._model = weakref.ref(model if model is not None else params) \
            if isinstance(model if model is not None else params, torch.nn.Module) else None
        self._threads = threads
        self._choice = _resolve_choice(backend)
        groups, entries = plan_groups(params, normuon_defaults, adamw_defaults, overrides, roles, self._row_blocks)
        # torch's schedulers read the keys of `defaults`: "betas" makes OneCycleLR and CyclicLR cycle betas[0]
        # (beta1) in every group; NorMuon groups carry their (beta1, beta2) as betas too.
        super().__init__(groups, dict(lr=normuon_defaults["lr"], betas=(normuon_defaults["beta1"], normuon_defaults["beta2"]),
                                      weight_decay=normuon_defaults["weight_decay"]))
        self._built = True
        self._build(entries)
        self.last_skip_reason = None
        suspects = vocabulary_lookalikes(entries)
        if suspects:
            warnings.warn(f"NorMuonAdamW: {', '.join(repr(e.name) for e in suspects)} went to NorMuon on their "
                          "names alone but are shaped like an embedding or output head (the token embedding's "
                          "shape, or a vocabulary-sized dimension no hidden matrix has). Pass the model "
                          "(NorMuonAdamW(model) or model=), or roles= / overrides= to say what they are. The "
                          "routing:\n" + self.routing_text(), stacklevel=2)
        doubts = output_layer_doubts(entries)
        if doubts:
            warnings.warn("NorMuonAdamW: " + "; ".join(doubts) + ". The routing:\n" + self.routing_text(),
                          stacklevel=2)

    # ------------------------------------------------------------------------------------------- building

    def _build(self, entries, keep=()):
        """Everything below the param groups: checked values, layout, buffers, backend, the state views.
        Frozen parameters are left out of the layout (self._frozen), unless their id is in `keep` (they
        had state)."""
        devices = sorted({str(e.tensor.device) for e in entries})
        if len(devices) > 1:
            raise ValueError(f"NorMuonAdamW needs every parameter on one device; got {', '.join(devices)}")
        self._device = entries[0].tensor.device if entries else torch.device("cpu")
        self._frozen = [] if self._state_for_frozen else [
            e for e in entries if not e.tensor.requires_grad and e.tensor.grad is None and id(e.tensor) not in keep]
        frozen = {id(e) for e in self._frozen}
        self._entries = entries = [e for e in entries if id(e) not in frozen]
        self._betas_seen = [(g["beta1"], g["beta2"]) if g["algorithm"] == "normuon" else None
                            for g in self.param_groups]
        self._hypers = [self._validated(i, g) for i, g in enumerate(self.param_groups)]  # checked values
        self._allocate(self._threads)
        # The fields the layout and the backend's plan were built from: the engine says which.
        self._fixed_keys = tuple(self._engine.fixed_fields if self._engine is not None else _C.layout_fields())
        self._fixed = [{k: h[k] for k in self._fixed_keys if k in h} for h in self._hypers]
        self.state = defaultdict(dict)
        for e in entries:  # live views, for inspection as with torch's optimizers
            self.state[e.tensor] = self._state_views(e)

    def _allocate(self, threads):
        """The manifest, layout, the optimizer's own memory and the backend. Table mode: the step reads the
        model's gradients and writes its parameters where they are; the optimizer holds its state and, for
        bf16/fp16 parameters only, their fp32 masters (docs/python.md, "Memory"). The native engine holds
        all of it, the counters too; only the Python reference keeps its own."""
        self._engine = None     # the native engine (fast-cpu, fast-cuda): layout, options, state, counters
        self._reference = None  # the per-parameter Python reference
        self._host_steps = [0] * len(self.param_groups)  # the reference's counters
        self._host_entry_steps = [0] * len(self._entries)
        if self._device.type == "cuda":
            index = self._device.index if self._device.index is not None else torch.cuda.current_device()
            self._device = torch.device("cuda", index)
        self._options = _C.Options([(g["name"], g["algorithm"]) for g in self.param_groups])
        self._synced = [dict() for _ in self.param_groups]
        self._manifest = _C.Manifest(self._specs())
        self._push_options()  # the groups' checked values; then the engine holds them
        if self._choice == "reference":
            self._layout = _C.Layout.build(self._manifest, self._options)
            buffers = {k: torch.zeros(n, device=self._device) for k, n in self._buffer_sizes().items()}
            self._reference = reference.ReferenceBackend()
        else:
            buffers = self._allocate_engine(threads)
        for e, le in zip(self._entries, self._layout.entries):  # the second-moment axis, as the layout has it
            e.stats_per_row = le.stats_per_row
            e.stat_len = le.stat_len
        self._carve(buffers)
        self._init_masters()

    def _specs(self, names=None):
        """The C++ manifest's rows (ParamSpec) of this optimizer, under other parameter names if given."""
        groups = [g["name"] for g in self.param_groups]
        default_group = {"normuon": "normuon", "adamw": "adamw"}
        names = names or [e.name for e in self._entries]
        return [_C.ParamSpec(n, list(e.shape), DTYPES[e.dtype], e.role,
                             "" if groups[e.group] == default_group[e.algorithm] else groups[e.group], e.override)
                for n, e in zip(names, self._entries)]

    def _buffer_sizes(self):
        l = self._layout
        return dict(masters=l.master_floats, momentum=l.normuon_floats, row_var=l.stat_floats,
                    exp_avg=l.adam_floats, exp_avg_sq=l.adam_floats)

    def _allocate_engine(self, threads):
        """The native engine over the model's own tensors: the fast CPU backend, or the fast CUDA one on the
        parameters' device (its buffers in device memory, viewed zero-copy). No silent fallback."""
        where = f"backend '{self._choice}' on {self._device}"
        no_fallback = "no fallback to another device or the reference; ask for backend='reference' explicitly"
        device = -1 if self._device.type == "cpu" else self._device.index
        if self._device_backend is not None:
            backend = (self._device_backend, device)
        elif self._device.type == "cpu":
            if not _C.has_fast_cpu:  # _C built without oneDNN (-DNORMUON_BUILD_FAST_CPU=OFF)
                raise RuntimeError(f"{where} needs the fast CPU backend, which this build of normuon._C does not "
                                   f"have (configured without oneDNN, -DNORMUON_BUILD_FAST_CPU=OFF); {no_fallback}, "
                                   "put the parameters on a CUDA device, or rebuild with oneDNN")
            # threads=None follows torch's setting (several ranks per node share the cores as torch does).
            backend = (torch.get_num_threads() if threads is None else threads,)
        else:
            cuda, why = cuda_module()
            if cuda is None:
                raise ValueError(f"{where}: {why} ({no_fallback})")
            backend = (cuda.engine_backend(device, self._stream()), device)
        try:
            with (torch.cuda.device(self._device) if device >= 0 else contextlib.nullcontext()):
                engine = _C.Engine(self._manifest, self._options, *backend)
        except ValueError as error:
            raise ValueError(f"{where} cannot serve this request: {error} ({no_fallback})") from None
        engine.verdict = self.verdict
        self._engine = engine
        self._synced = [dict(h) for h in self._hypers]
        self._layout = engine.layout
        blocks = [(0, 0, 0) if e.block is None else (e.block.offset, *e.block.runs) for e in self._entries]
        engine.bind([e.source for e in self._entries], blocks if self._row_blocks else [],
                    [e.tensor for e in self._frozen])
        return {k: torch.from_numpy(v) if not isinstance(v, tuple) else _device_view(engine, *v, self._device)
                for k, v in engine.buffers().items()}

    def _carve(self, buffers):
        """Per-entry views of the optimizer's buffers (host or device): state and masters."""
        self._buffers = {k: buffers[k] for k in self._buffer_sizes()}
        for e, le in zip(self._entries, self._layout.entries):
            if e.algorithm == "normuon":
                e.state = (buffers["momentum"][le.offset:le.offset + le.numel].view(e.shape),
                           buffers["row_var"][le.stat_offset:le.stat_offset + le.stat_len])
            else:
                adam = slice(le.adam_offset, le.adam_offset + le.numel)
                e.state = (buffers["exp_avg"][adam].view(e.shape), buffers["exp_avg_sq"][adam].view(e.shape))
            e.master = (buffers["masters"][le.master_offset:le.master_offset + le.numel].view(e.shape)
                        if e.low_precision else None)
            if e.block is not None and e.master is None and self._reference is not None:
                e.master = torch.empty(e.shape, device=self._device)  # the reference's working copy

    def _init_masters(self):
        """The fp32 masters of bf16/fp16 parameters from the model (the only copy the optimizer makes)."""
        for e in self._entries:
            if e.master is not None:
                e.read_into(e.master)
            e.version = _seen(e)
        self._masters_are_current()

    def _masters_are_current(self):
        """Python just wrote masters (and parameters): the engine takes the tensors as they are now, so its
        next step reads no master again (a loaded master keeps its low bits)."""
        if self._engine is not None:
            self._engine.mark_current()

    @staticmethod
    def _state_views(e):
        if e.algorithm == "normuon":
            return {"momentum_buffer": e.state[0], "moment2_buffer": e.state[1]}
        return {"exp_avg": e.state[0], "exp_avg_sq": e.state[1]}

    def add_param_group(self, param_group):
        """torch's add_param_group (a layer unfrozen, a head added): a dict with "params" and, optionally,
        "name", "algorithm" and hyper-parameters, as in the constructor ("auto" splits it by the routing
        rule; the model given to the constructor names and routes its tensors). The layout, buffers and
        backend are built again over every parameter: the parameters already here keep their state, masters
        and routing and the groups their step counters; the new group starts from zero. Nothing changes on
        an error."""
        if not getattr(self, "_built", False):  # torch's __init__ adds the constructor's groups
            return super().add_param_group(param_group)
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise ValueError("add_param_group takes a dict with 'params' (and optionally 'name', 'algorithm' and "
                             "hyper-parameters)")
        self._sync_hyper()  # the current values of the existing groups, checked
        self._settle()
        self._refresh_masters()
        kept, extra = [], {}
        for g in self.param_groups:
            keys = NORMUON_FIELDS if g["algorithm"] == "normuon" else ADAMW_KEYS
            kept.append(dict({k: g[k] for k in keys}, params=list(zip(g["names"], g["params"])), name=g["name"],
                             algorithm=g["algorithm"]))
            # What schedulers and users keep in a group (initial_lr, max_lr, ...) stays with it.
            extra[g["name"]] = {k: v for k, v in g.items() if k not in set(keys) | _GROUP_OWN_KEYS}
        model = self._model() if self._model is not None else None
        known = {"params", "names", "name", "algorithm", "momentum", "betas"} | set(NORMUON_FIELDS) | \
            set(ADAMW_KEYS) | set(ADAMW_PREFIXED)
        new_extra = {k: v for k, v in param_group.items() if k not in known}  # a scheduler's initial_lr, ...
        added, roles = resolve_inputs([{k: v for k, v in param_group.items() if k in known}], model=model)
        old = {id(e.tensor): e for e in self._entries + self._frozen}
        roles.update({e.name: (e.role, e.evidence) for e in old.values()})
        groups, entries = plan_groups(kept + added, *self._defaults_by_algorithm, {}, roles, self._row_blocks)
        devices = sorted({str(e.tensor.device) for e in entries})
        if len(devices) > 1:
            raise ValueError(f"NorMuonAdamW needs every parameter on one device; got {', '.join(devices)}")
        for i, g in enumerate(groups):  # every value checked before anything is swapped
            self._validated(i, dict(g))
        for e in entries:
            if id(e.tensor) in old:  # routing as it was
                was = old[id(e.tensor)]
                e.role, e.evidence, e.why, e.override = was.role, was.evidence, was.why, was.override
        steps = {g["name"]: t for g, t in zip(self.param_groups, self._steps)}
        self.param_groups = []
        for g in groups:
            g.update(extra.get(g["name"], new_extra))
            super().add_param_group(g)
        self._rebuild(entries, [steps.get(g["name"], 0) for g in self.param_groups])

    def _rebuild(self, entries, steps):
        """The layout, buffers and backend built again over `entries` (every parameter of param_groups):
        the parameters laid out before keep their state, masters and own counts (a new one starts at 0);
        steps: the group counters."""
        self._settle()  # a pending verdict and outside writes belong to the layout they were made on
        self._refresh_masters()
        old = {id(e.tensor): e for e in self._entries}
        saved = {i: ([t.clone() for t in e.state], e.master.clone() if e.low_precision else None)
                 for i, e in old.items()}
        own_steps = {id(e.tensor): t for e, t in zip(self._entries, self._entry_steps)}
        self._build(entries, keep=set(old))
        for e in self._entries:
            if id(e.tensor) in old:
                state, master = saved[id(e.tensor)]
                for dst, src in zip(e.state, state):
                    dst.copy_(src)
                if master is not None:
                    e.master.copy_(master)
        self._masters_are_current()
        self._set_steps(steps, [own_steps.get(id(e.tensor), 0) for e in self._entries])

    def _unfreeze_if_needed(self):
        """Frozen parameters that now have a gradient are laid out (state from zero), as torch's optimizers
        start a parameter's state at its first gradient. One native call finds them on the engine."""
        woken = (self._engine.frozen_with_grad() if self._engine is not None
                 else [i for i, e in enumerate(self._frozen) if e.tensor.grad is not None])
        if woken:
            self._rebuild(sorted(self._entries + self._frozen, key=lambda e: e.index), list(self._steps))

    # ------------------------------------------------------------------------------ hyper-parameters

    def _validated(self, i, group, seen=None):
        """The group's hyper-parameters in the spec's field names, checked; ValueError names the group.
        seen: a NorMuon group's (beta1, beta2) as last read, to tell which of its two forms changed."""
        try:
            if group["algorithm"] == "normuon":
                _normuon_betas(group, seen)
                raw = {k: group[k] for k in NORMUON_FIELDS}
            else:
                betas = tuple(group["betas"])
                if len(betas) != 2:
                    raise ValueError(f"betas={group['betas']!r} is not a pair")
                raw = dict(lr=group["lr"], beta1=betas[0], beta2=betas[1], eps=group["eps"],
                           weight_decay=group["weight_decay"])
            values = check_values(group.get("name", f"group{i}"), group["algorithm"], raw)
        except KeyError as missing:
            raise ValueError(f"param_groups[{i}] ('{group.get('name')}'): missing key {missing}") from None
        except ValueError as error:
            raise ValueError(f"param_groups[{i}] ('{group.get('name')}', {group['algorithm']}): {error}") from None
        return values

    def _sync_hyper(self):
        """Reads every group's values (schedulers change them between steps) into the options."""
        if self.nonfinite not in ("error", "skip_step"):
            raise ValueError(f"nonfinite={self.nonfinite!r}: choose error | skip_step")
        hypers = [self._validated(i, g, self._betas_seen[i]) for i, g in enumerate(self.param_groups)]
        self._betas_seen = [(g["beta1"], g["beta2"]) if g["algorithm"] == "normuon" else None
                            for g in self.param_groups]
        for i, h in enumerate(hypers if self._engine is None else ()):  # the engine refuses these itself
            for k in self._fixed_keys:
                if k in h and h[k] != self._fixed[i][k]:
                    raise ValueError(f"option '{self.param_groups[i]['name']}.{k}' was {self._fixed[i][k]!r} when "
                                     f"the optimizer was built and decides its layout; it cannot become {h[k]!r}")
        self._hypers = hypers
        self._push_options()
        return hypers

    def _reconcile_betas(self):
        """Both forms of every NorMuon group's pair agree again (as the next step would make them)."""
        for i, g in enumerate(self.param_groups):
            if g["algorithm"] == "normuon":
                self._betas_seen[i] = _normuon_betas(g, self._betas_seen[i])

    def _push_options(self):
        """Checked values into the native options (the engine's, or the CUDA backend's), typed; only groups
        whose values changed since the last push."""
        target = self._engine if self._engine is not None else self._options
        for i, h in enumerate(self._hypers):
            if self._synced[i] != h:
                target.set_group(i, h)
                self._synced[i] = dict(h)
        if self._engine is not None:
            self._engine.set_nonfinite(self.nonfinite)
        else:
            self._options.set("nonfinite", self.nonfinite)

    # -------------------------------------------------------------------------------------- the step

    def _refresh_masters(self):
        """Outside writes to the model's parameters. An fp32 parameter is its own master: nothing to do. A
        bf16/fp16 one whose version counter moved (load_state_dict, an in-place op under no_grad) or whose
        storage is new (p.data = t) gets its master from it, unless it still holds the rounded master (a
        model reloaded after the optimizer: the master keeps its low bits). In-place writes through .data
        bypass the counter and are not seen. The engine applies its own rule (Engine::refresh_master); the
        Python reference's is written here."""
        if self._engine is not None:
            self._engine.refresh_masters(self._stream())
            return
        for e in self._entries:
            t = e.source
            shape = e.shape if e.block is None else e.block.param_shape
            if tuple(t.shape) != shape or t.dtype != e.dtype or t.device != self._device:
                raise RuntimeError(f"parameter '{e.name}' is now {t.dtype} {list(t.shape)} on {t.device}; it was "
                                   f"{e.dtype} {list(shape)} on {self._device} when the optimizer was built")
            version = _seen(e)
            if e.block is not None and e.master is not None and not e.low_precision:
                e.read_into(e.master)  # the reference's working copy of a block: writes through .data too
            elif version != e.version:
                if e.master is not None:
                    values = e.values()
                    if not (e.low_precision and torch.equal(values, e.master.to(e.dtype))):
                        e.master.copy_(values)
            e.version = version
        self._masters_are_current()

    def _stream(self):
        """The stream the engine's device work goes to: the caller's current one on CUDA (a handle; 0 is
        torch's default, the legacy stream), None on the CPU."""
        return torch.cuda.current_stream(self._device).cuda_stream if self._device.type == "cuda" else None

    # The counters: the engine's where there is one (read, never copied), else the host's.
    @property
    def _steps(self):
        return self._engine.group_steps if self._engine is not None else self._host_steps

    @_steps.setter
    def _steps(self, steps):
        self._host_steps = steps

    @property
    def _entry_steps(self):
        return self._engine.entry_steps if self._engine is not None else self._host_entry_steps

    @_entry_steps.setter
    def _entry_steps(self, steps):
        self._host_entry_steps = steps

    def _set_steps(self, steps, entry_steps=None):
        """The group counters and the parameters' own counts (entry_steps, per entry; None: each at its
        group's counter, what state of format version 1 means), in the engine (checked there first; a
        device's copy follows) or the reference's, and group['step']."""
        steps = [int(t) for t in steps]
        entry_steps = ([steps[e.group] for e in self._entries] if entry_steps is None
                       else [int(t) for t in entry_steps])
        if self._engine is not None:  # (callers settle a pending verdict first: its reason is theirs to keep)
            if steps != self._steps or entry_steps != self._entry_steps:  # else no device write
                self._engine.set_steps(steps, entry_steps)
        else:
            self._steps, self._entry_steps = list(steps), list(entry_steps)
        self._publish_steps()

    def _publish_steps(self):
        """group['step'] from the counters (the engine's, or the reference's): no copy kept by hand."""
        for g, t in zip(self.param_groups, self._steps):
            g["step"] = t

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """One optimizer step over every parameter with a gradient (parameters without one are left as
        they are). Raises RuntimeError for a NaN/Inf gradient under nonfinite='error', before anything
        changes; under 'skip_step' nothing changes and last_skip_reason says why. On CUDA with
        verdict='deferred' that verdict comes at the next step() (the bad step changed nothing).
        kwargs: grad_scaler=, which torch 1.13's GradScaler passes (see _scaler)."""
        unknown = sorted(set(kwargs) - {"grad_scaler"})
        if unknown:
            raise TypeError(f"step() got unexpected keyword argument(s) {', '.join(unknown)}")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hypers = self._sync_hyper()
        if self._frozen:
            self._unfreeze_if_needed()
        scaler = self._scaler(kwargs.get("grad_scaler"))
        if self._engine is not None and self._threads is None and self._engine.threads not in (0, torch.get_num_threads()):
            self._engine.set_threads(torch.get_num_threads())  # torch's count changed: follow it (0: no CPU threads)
        if self._engine is not None:  # one native call: the tensors' addresses, versions and gradients, the step
            scale, found = (0, 0) if scaler is None else (0 if scaler[0] is None else scaler[0].data_ptr(),
                                                          scaler[1].data_ptr())
            if self._device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("NorMuonAdamW.step() cannot be captured in a CUDA graph yet: its step is "
                                   "enqueued by the native engine, which reads its verdict and uploads its "
                                   "values from the host; call step() outside the capture")
            try:
                result = self._engine.step(scale, found, self._stream())
            finally:  # a deferred verdict raised here has rolled the counters back
                self._publish_steps()
            skipped = result.reason if result.skipped else None
        elif scaler is not None and float(scaler[1]) != 0:
            skipped = FOUND_INF_REASON
        else:
            self._refresh_masters()
            skipped = self._reference_step(hypers, None if scaler is None or scaler[0] is None
                                           else scaler[0].to(device="cpu"))
        self._publish_steps()
        self.last_skip_reason = skipped
        return loss

    # torch.compile(opt.step), or a compiled train step that calls it: the step runs as it is, a graph break
    # around it (Dynamo cannot trace into the native call, and need not: it is one call already).
    if hasattr(torch, "compiler") and hasattr(torch.compiler, "disable"):
        step = torch.compiler.disable(step)

    def _scaler(self, grad_scaler=None):
        """torch's GradScaler with this optimizer (_step_supports_amp_scaling): (scale or None, found_inf) as
        fp32 scalars on the parameters' device, or None without a scaler. The step divides every gradient
        by the scale as it reads it and changes nothing when found_inf is set, as torch's fused AdamW does.
        torch >= 2.0 hands both over as attributes for one step; after scaler.unscale_(opt) (to clip) the
        scale is None: the gradients are unscaled already. torch 1.13 passes itself (grad_scaler=): its
        unscale_ then runs here (a pass of its own, as for any optimizer) and gives found_inf."""
        if grad_scaler is not None:
            state = grad_scaler._per_optimizer_states[id(self)]
            if not state["found_inf_per_device"]:  # unscale_ not called yet this iteration
                grad_scaler.unscale_(self)
            found = sum(float(v) for v in state["found_inf_per_device"].values())
            return None, torch.tensor(found, dtype=torch.float32, device=self._device)
        scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        if found_inf is None:
            if scale is not None:
                raise ValueError("a gradient scaler handed over grad_scale without found_inf")
            return None
        found_inf = found_inf.detach().to(device=self._device, dtype=torch.float32).reshape(()).contiguous()
        if scale is not None:
            scale = scale.detach().to(device=self._device, dtype=torch.float32).reshape(()).contiguous()
            if self._device.type == "cpu" and not (math.isfinite(float(scale)) and float(scale) > 0):
                raise ValueError(f"the gradient scaler's scale {float(scale)!r} is not finite and > 0")
        return scale, found_inf

    def _reference_step(self, hypers, grad_scale=None):
        """The old path, per parameter: fp32 gradients, the spec's ops, rounded parameters copied back."""
        for e in self._entries:
            g = _dense_grad(e)
            e.has_grad = g is not None
            if g is not None:
                g = g.detach() if e.block is None else e.block.values(g.detach())
                e.grad = g.to(torch.float32)
                if grad_scale is not None:
                    e.grad = e.grad / grad_scale.to(e.grad.device)
        steps, entry_steps = list(self._steps), list(self._entry_steps)
        skipped = self._reference.step(self._entries, hypers, steps, entry_steps, self.nonfinite)
        if skipped is None:
            self._steps, self._entry_steps = steps, entry_steps
            for e in self._entries:
                if e.has_grad and e.master is not None:
                    e.write(e.master)  # rounds to the parameter's dtype
                e.version = _seen(e)
        return skipped

    def _settle(self):
        """verdict='deferred': the pending step's verdict now (the next step(), state_dict, state files), so
        the counters are final. Returns the reason that step was skipped, or None; raises as step() would
        under nonfinite='error'. That step changed nothing, its counters included (the engine rolls them
        back)."""
        if self._engine is None or not self._engine.pending:
            return None
        result = self._engine.settle()
        reason = result.reason if result.skipped else None
        if reason is not None:
            self.last_skip_reason = reason
        self._publish_steps()
        return reason

    def _to_flat(self):
        """A host FlatState of this optimizer (parameters as fp32 masters, state, steps): what state files hold."""
        self._settle()
        flat = _C.FlatState(self._layout)
        params = torch.from_numpy(flat.params)
        for e, le in zip(self._entries, self._layout.entries):
            src = e.master if e.master is not None else e.values()
            params[le.offset:le.offset + le.numel].copy_(src.reshape(-1))
        for k, t in self._buffers.items():
            if k != "masters":
                torch.from_numpy(getattr(flat, k)).copy_(t)
        flat.group_steps = self._steps
        flat.entry_steps = self._entry_steps
        return flat

    def _from_flat(self, flat):
        """The optimizer (state, masters, steps) and the model's parameters from a host FlatState."""
        params = torch.from_numpy(flat.params)
        for k, t in self._buffers.items():
            if k != "masters":
                t.copy_(torch.from_numpy(getattr(flat, k)))
        for e, le in zip(self._entries, self._layout.entries):
            values = params[le.offset:le.offset + le.numel].view(e.shape)
            if e.master is not None:
                e.master.copy_(values)
            e.write(values)  # rounds to the parameter's dtype
            e.version = _seen(e)
        self._masters_are_current()
        self._set_steps(list(flat.group_steps), list(flat.entry_steps))

    # ----------------------------------------------------------------------------------- inspection

    @property
    def backend(self):
        """Which backend runs the steps: 'fast-cpu', 'fast-cuda' or 'reference-python'."""
        return self._engine.backend if self._engine is not None else self._reference.name

    def memory_report(self):
        """Bytes the optimizer holds beyond the model's tensors: state_bytes (momentum, second moments,
        exp_avg, exp_avg_sq), master_bytes (fp32 masters of bf16/fp16 parameters: 4 B per element) and
        workspace_bytes (the native backend's Newton-Schulz buffers and scratch; for the reference, only its
        working copies of blocks of rows)."""
        if self._engine is not None:
            return self._engine.memory_report()
        sizes = self._buffer_sizes()
        masters = 4 * sizes.pop("masters")
        # The Python reference's working copies of fp32 blocks of rows (the old path copies them).
        working = 4 * sum(e.master.numel() for e in self._entries
                          if e.block is not None and not e.low_precision and e.master is not None)
        return dict(state_bytes=4 * sum(sizes.values()), master_bytes=masters, workspace_bytes=working)

    @property
    def layout(self):
        """The C++ Layout (normuon._C.Layout): placement, buckets, fingerprint."""
        return self._layout

    def routing_table(self):
        """One row per parameter (manifest order): which algorithm and group it got, and why."""
        frozen = {id(e) for e in self._frozen}
        return [dict(index=e.index, name=e.name, shape=tuple(e.shape), dtype=DTYPES[e.dtype], role=e.role,
                     algorithm=e.algorithm, group=self.param_groups[e.group]["name"],
                     why=e.why + (" (frozen: no state until it has a gradient)" if id(e) in frozen else ""),
                     stats=("" if e.algorithm == "adamw" or id(e) in frozen else "rows" if e.stats_per_row else "cols"))
                for e in sorted(self._entries + self._frozen, key=lambda e: e.index)]

    def routing_text(self):
        return routing_text("NorMuonAdamW", self.routing_table(),
                            f"backend {self.backend}; layout {self._layout.fingerprint}")

    def print_routing(self, file=None):
        print(self.routing_text(), file=file)

    def manifest_csv(self):
        """The C++ manifest of this optimizer (name,shape,dtype,role,group,algorithm) as CSV text."""
        return self._manifest.to_csv()

    def write_manifest(self, path):
        """Writes the manifest, for `normuon run --manifest PATH` / `normuon layout --manifest PATH`."""
        self._manifest.write_csv(os.fspath(path))

    # ----------------------------------------------------------------------------------- state dicts

    def state_dict(self):
        """torch's structure: "state" by parameter index (param_groups order) with fp32 copies of
        momentum_buffer + moment2_buffer (NorMuon; moment2 is the reduced second moment, length rows or
        cols) or exp_avg + exp_avg_sq (AdamW), plus master_param for non-fp32 parameters and, as torch's
        AdamW, 'step': the parameter's own count (a 0-d fp32 tensor: the steps it had a gradient in, which
        its AdamW bias corrections use); "param_groups" with the hyper-parameters, names and the group's
        step. torch's state-dict hooks (torch >= 2.1:
        register_state_dict_pre_hook / _post_hook) run around it as around torch's own."""
        for hook in list(getattr(self, "_optimizer_state_dict_pre_hooks", {}).values()):
            hook(self)
        self._refresh_masters()
        self._settle()
        self._reconcile_betas()  # a scheduler may have moved betas since the last step
        by_tensor = {id(e.tensor): (e, t) for e, t in zip(self._entries, self._entry_steps)}
        groups, state, index = [], {}, 0
        for g in self.param_groups:
            packed = {k: (list(v) if isinstance(v, list) else v) for k, v in g.items() if k != "params"}
            packed["params"] = list(range(index, index + len(g["params"])))
            for t in g["params"]:
                if id(t) not in by_tensor:  # frozen: no state, as torch has none for a parameter never stepped
                    index += 1
                    continue
                e, own = by_tensor[id(t)]
                s = {k: v.clone() for k, v in self._state_views(e).items()}
                if e.low_precision:
                    s["master_param"] = e.master.clone()
                s["step"] = torch.tensor(float(own))
                state[index] = s
                index += 1
            groups.append(packed)
        state_dict = {"state": state, "param_groups": groups}
        for hook in list(getattr(self, "_optimizer_state_dict_post_hooks", {}).values()):
            result = hook(self, state_dict)
            state_dict = state_dict if result is None else result
        return state_dict

    def load_state_dict(self, state_dict):
        """Checks everything first (group count, algorithms, parameter counts and names, state keys and
        shapes, hyper-parameters), then writes into the flat state: nothing changes on an error. Parameter
        names are compared without wrapper prefixes (module., _orig_mod., ...), so a state dict saved under
        DDP or torch.compile loads without them, and back. torch's load-state-dict hooks (torch >= 2.1) run
        around it as around torch's own."""
        if isinstance(state_dict, dict):
            state_dict = dict(state_dict)  # a pre-hook may edit it: never the caller's
        for hook in list(getattr(self, "_optimizer_load_state_dict_pre_hooks", {}).values()):
            result = hook(self, state_dict)
            state_dict = state_dict if result is None else result
        self._load_state_dict(state_dict)
        for hook in list(getattr(self, "_optimizer_load_state_dict_post_hooks", {}).values()):
            hook(self)

    def _load_state_dict(self, state_dict):
        self._settle()  # a pending deferred verdict must not move the counters about to be loaded
        if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
            raise ValueError("not a NorMuonAdamW state dict: expected the keys 'state' and 'param_groups'")
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(saved_groups)} param groups, this optimizer "
                             f"{len(self.param_groups)} ({', '.join(g['name'] for g in self.param_groups)})")
        by_tensor = {id(e.tensor): e for e in self._entries}
        writes, new_groups, steps, own_steps = [], [], [], {}
        for i, (sg, g) in enumerate(zip(saved_groups, self.param_groups)):
            where = f"param_groups[{i}] ('{g['name']}')"
            if sg.get("algorithm", g["algorithm"]) != g["algorithm"]:
                raise ValueError(f"{where}: saved as a {sg.get('algorithm')} group, this one is {g['algorithm']}")
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(f"{where}: {len(sg['params'])} parameters saved, {len(g['params'])} here")
            saved_names = list(map(strip_wrappers, sg.get("names", g["names"])))
            if saved_names != list(map(strip_wrappers, g["names"])):
                diff = next((f"'{a}' saved vs '{b}' here" for a, b in zip(sg["names"], g["names"])
                             if strip_wrappers(a) != strip_wrappers(b)), "a different count")
                raise ValueError(f"{where}: parameter names differ ({diff})")
            step = sg.get("step", 0)
            if not isinstance(step, int) or step < 0:
                raise ValueError(f"{where}: step={step!r} is not a non-negative integer")
            steps.append(step)
            new = {k: v for k, v in sg.items() if k != "params"}
            new["params"], new["name"], new["names"] = g["params"], g["name"], g["names"]
            self._validated(i, new)
            for k in self._fixed_keys:
                if k in new and new[k] != g[k]:
                    raise ValueError(f"{where}: {k} is {new[k]!r} in the state dict but {g[k]!r} here (it decides "
                                     f"the {'layout' if k in _C.layout_fields() else 'backend plan'})")
            new_groups.append(new)
            for k, (idx, t) in enumerate(zip(sg["params"], g["params"])):
                if id(t) not in by_tensor:  # frozen here
                    if saved_state.get(idx):
                        raise ValueError(f"{where}: the state dict has state for parameter '{g['names'][k]}', "
                                         "which was frozen when this optimizer was built (requires_grad=False, no "
                                         "gradient: no state): make it trainable before building the optimizer")
                    continue
                e = by_tensor[id(t)]
                s = saved_state.get(idx)
                if s is None:
                    s = {k: torch.zeros_like(v) for k, v in self._state_views(e).items()}  # never stepped
                    s["step"] = 0
                # The parameter's own count; a state dict without one (saved before counts were kept) means
                # the group's, which is what its bias corrections used then.
                s = dict(s)
                own_steps[id(e.tensor)] = _own_step(s.pop("step", step), step, f"parameter '{e.name}'")
                expected = dict(self._state_views(e))
                if e.low_precision and "master_param" in s:
                    expected["master_param"] = e.master
                if set(s) != set(expected):
                    raise ValueError(f"state of parameter '{e.name}' ({e.algorithm}) has keys {sorted(s)}, "
                                     f"expected {sorted(expected)}")
                for k, dst in expected.items():
                    src = s[k]
                    if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(dst.shape):
                        got = tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
                        raise ValueError(f"state '{k}' of parameter '{e.name}' has shape {got}, expected "
                                         f"{tuple(dst.shape)}")
                    if not src.is_floating_point():
                        raise ValueError(f"state '{k}' of parameter '{e.name}' is {src.dtype}, not floating point")
                    writes.append((dst, src))
        for dst, src in writes:
            dst.copy_(src)
        for e in self._entries:  # the masters just loaded win over the model's values as they are now
            e.version = _seen(e)
        self._masters_are_current()
        for g, new in zip(self.param_groups, new_groups):
            g.clear()
            g.update(new)
        self._set_steps(steps, [own_steps[id(e.tensor)] for e in self._entries])
        self._sync_hyper()

    # ----------------------------------------------------------------------------------- state files

    def export_state(self, path):
        """Writes the project's state file (docs/layout-and-state.md): fp32 master parameters, state,
        group steps and hyper-parameters. `normuon inspect PATH` reads it, `normuon run --load` resumes it."""
        self._sync_hyper()
        self._refresh_masters()
        options = self._engine.options if self._engine is not None else self._options
        _C.save_state(os.fspath(path), self._to_flat(), options, self.backend)

    def _file_layout(self, header):
        """This layout, or, when the file names the parameters with other wrapper prefixes (saved under DDP
        or torch.compile and loaded without, or back), the same layout under the file's names: the values
        sit at the same places, so the scratch state loads and moves over unchanged."""
        in_file = {t["name"] for t in header["tensors"]}
        ours = [e.name for e in self._entries]
        if header["layout_fingerprint"] == self._layout.fingerprint or set(ours) <= in_file:
            return self._layout  # load_state says what is wrong, if anything
        by_stripped = {}
        for name in in_file:
            by_stripped.setdefault(strip_wrappers(name), []).append(name)
        renamed = [by_stripped.get(strip_wrappers(n), [None]) for n in ours]
        if any(len(r) != 1 or r[0] is None for r in renamed):
            return self._layout
        layout = _C.Layout.build(_C.Manifest(self._specs([r[0] for r in renamed])), self._options)
        same_places = all((a.offset, a.stat_offset, a.adam_offset) == (b.offset, b.stat_offset, b.adam_offset)
                          for a, b in zip(layout.entries, self._layout.entries))
        return layout if same_places and layout.fingerprint == header["layout_fingerprint"] else self._layout

    def import_state(self, path):
        """Loads a state file of this layout (written by export_state or `normuon run --save`): all or nothing
        (StateFileError). Sets the optimizer state, group steps and hyper-parameters (not nonfinite, not
        reduce_axis), and the model's parameters from the file's fp32 values."""
        path = os.fspath(path)
        self._settle()  # as load_state_dict
        contents = _C.read_state_file(path)  # one read: the header looked at and the tensors are one version
        flat = _C.FlatState(self._file_layout(contents.header))
        saved = _C.load_state_file(contents, flat)  # all or nothing, into a scratch state
        # Every saved value is checked before anything moves: what the layout and the CUDA plan fixed, and
        # each group's values as a step would check them (a file with ns_steps=0 changed the state first).
        updated = []
        for i, g in enumerate(self.param_groups):
            h = saved.hyper(i)
            if g["algorithm"] == "adamw":
                new = dict(g, lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], weight_decay=h["weight_decay"])
            else:
                new = dict(g, **{k: v for k, v in h.items() if k not in _C.layout_fields()})
                new.pop("betas", None)  # follows beta1 / beta2
            try:
                values = self._validated(i, new)
            except ValueError as error:
                raise ValueError(f"{path}: {error}") from None
            if g["algorithm"] == "normuon":
                file_values = {k: h[k] for k in self._fixed_keys if k in h}  # checked by the core as read
                bad = [k for k, v in file_values.items() if v != self._fixed[i][k]]
                if bad:
                    raise ValueError(f"{path}: group '{g['name']}' was saved with "
                                     + ", ".join(f"{k}={h[k]!r}" for k in bad) + ", but this optimizer was built "
                                     "with " + ", ".join(f"{k}={self._fixed[i][k]!r}" for k in bad))
            del values
            updated.append(new)
        self._from_flat(flat)  # the group steps too
        for g, new in zip(self.param_groups, updated):
            g.update({k: v for k, v in new.items() if k not in ("params", "names", "name", "algorithm", "step")})
        self._sync_hyper()


_GROUP_OWN_KEYS = {"params", "names", "name", "algorithm", "step", "betas"}  # the optimizer's own group keys
FOUND_INF_REASON = _C.FOUND_INF_REASON  # the core's words


# torch.optim keywords: those that change nothing here are taken; the others name what they map to.
_TORCH_NEUTRAL = {"foreach": None, "fused": None, "amsgrad": False, "maximize": False, "capturable": None,
                  "differentiable": False}  # None: any value (the step is always one fused native call)
_TORCH_MAPPED = {
    "betas": "NorMuon's pair is beta1= (momentum) and beta2= (second moment); AdamW's is adamw_betas=",
    "eps": "AdamW's is adamw_eps=; NorMuon's denominator takes denom_eps=",
}


def _torch_keywords(knobs):
    """knobs without torch.optim's keywords that change nothing here; TypeError for one that maps elsewhere
    or asks for what is not supported."""
    out = {}
    for k, v in knobs.items():
        if k in _TORCH_MAPPED:
            raise TypeError(f"NorMuonAdamW takes no {k}=: {_TORCH_MAPPED[k]}")
        if k not in _TORCH_NEUTRAL:
            out[k] = v
        elif _TORCH_NEUTRAL[k] is not None and bool(v) != _TORCH_NEUTRAL[k]:
            raise ValueError(f"NorMuonAdamW does not support {k}={v!r} (its AdamW is torch's with {k}=False)")
    return out


def _resolve_choice(backend):
    """The core's rule (backend_choice.h): an explicit choice wins over NORMUON_BACKEND, then auto."""
    return require("NorMuonAdamW").resolve_backend_choice(backend or "")


def _own_step(value, group_step, where):
    """A parameter's saved 'step' (an int, or a 0-d tensor as torch's optimizers save it) as an int in
    [0, group_step]; ValueError otherwise."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= group_step:
        raise ValueError(f"state of {where}: step={value!r} is not an integer in [0, its group's step "
                         f"{group_step}]")
    return value


def _seen(e):
    """What tells an outside write to a parameter: its storage and its version counter."""
    t = e.source
    return t.data_ptr(), t._version


def _dense_grad(e):
    """The parameter's gradient, or None; a sparse one is refused."""
    g = e.source.grad
    if g is not None and g.is_sparse:
        raise RuntimeError(f"parameter '{e.name}' has a sparse gradient, which NorMuonAdamW does not support")
    return g


class _CudaArray:
    """A device buffer of the native engine as __cuda_array_interface__, for a zero-copy torch view. The view
    keeps this object, and so the engine that owns the memory, alive."""

    def __init__(self, owner, ptr, n, typestr):
        self._owner = owner
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": typestr, "data": (ptr, False), "version": 2}


def _device_view(owner, ptr, n, typestr, device):
    """An fp32 buffer ('<f4') of the engine in device memory as a torch tensor on `device`."""
    if n == 0:
        return torch.zeros(0, dtype=torch.float32, device=device)
    return torch.as_tensor(_CudaArray(owner, ptr, n, typestr), device=device)
