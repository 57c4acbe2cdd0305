"""NorMuonAdamW: the NorMuon + AdamW hybrid (docs/spec.md) as a torch.optim.Optimizer.

A client of the native engine (engine.py over normuon._C.Engine): it plans the groups (plan.py), hands
the engine the model's tensors and the groups' checked values, and makes one native call per step. The
engine holds the layout, the state and every counter, on the CPU or on a CUDA device; the optimizer's
state tensors are zero-copy views of its buffers.
"""
import copy
import math
import os
import re
import warnings
import weakref
from collections import defaultdict

import torch

from .engine import (FOUND_INF_REASON, Engine, by_parameter, is_piece, named_state, one_device,  # noqa: F401
                     param_state, resolve_modes)
from .sharded import Shards, is_sharded
from .native import (_C, StateFileError, check_values, cuda_unavailable_reason, defaults, native_error,  # noqa: F401
                     require)
from .plan import (ADAMW_KEYS, ADAMW_PREFIXED, DTYPES, NORMUON_FIELDS, _normuon_betas, param_names,  # noqa: F401
                   plan_groups, resolve_inputs, route)
from .routing import (ROUTING_COLUMNS, expand_patterns, high_rank_by_rule, infer_role,  # noqa: F401
                      output_layer_doubts, router_roles, routing_text, strip_wrappers, vocabulary_lookalikes)

NORMUON_KNOBS = NORMUON_FIELDS[6:]  # everything after lr .. ns_steps

class NotCopyable:
    """The optimizers of this package refuse pickling and copying with a TypeError: a copy would share or
    lose the native buffers and the bindings to the model's tensors, and step wrongly."""

    def __reduce_ex__(self, protocol):  # pickle, and copy.copy / copy.deepcopy, which fall back on it
        raise TypeError(f"{type(self).__name__} cannot be pickled or copied: its state lives in native buffers "
                        "bound to the model's own tensors. Save opt.state_dict() (torch.save) or "
                        "opt.export_state(path), and build a new optimizer over the new model, then load it")


class NorMuonAdamW(NotCopyable, torch.optim.Optimizer):
    """NorMuon on 2-D hidden matrices, AdamW on everything else (docs/spec.md, docs/python.md).

    params: the model (recommended: its modules tell the embeddings and the head, routing.py),
        model.named_parameters(), a list of tensors (not a tensor: TypeError, as torch), or param groups: dicts
        with "params" (tensors or (name, tensor) pairs), optional "param_names" (torch's key; "names" is read
        too), "name", "algorithm" ("auto" | "normuon" | "adamw") and hyper-parameters. An "auto" group (the
        default) is split by the routing rule into a NorMuon and an AdamW group (an empty half is left out); it
        takes NorMuon keys plus adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay. Names are given for all
        parameters or none (torch's rule); groups of named parameters carry param_names.
    normuon_params, adamw_params: instead of params, an explicit split (one group each).
    model: beside params, the module they come from: bare tensors get its names and its modules' roles.
    lr, beta1 (alias momentum), beta2, weight_decay, nesterov, ns_steps, **knobs: NorMuon defaults
        (knobs: ns_coefficients, ns_precision, reduce_axis, lr_scale, weight_decay_mode, eps_placement,
        ns_eps, denom_eps, renorm_eps).
    adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW defaults.
    split_rows: {name: parts}: a matrix, or each expert of a bank, stepped as `parts` blocks of consecutive rows,
        each a matrix of its own (a fused gate_up projection's halves: {"*.gate_up_proj": 2}). None: whole.
    transposed: {name: bool}: matrices (or banks) stored [in, out], whose neurons are the stored columns: NorMuon's
        statistics and shape factor follow them. Over the modules' word: transformers' Conv1D weights (GPT-2) are;
        {"*": False} steps every matrix by its stored rows.
    overrides: {name: "normuon" | "adamw" | "auto"}, wins over the rule. roles: {name: role} (matrix, embedding,
        head, norm, bias, other, router, experts: a MoE bank [E, m, n], E matrices stepped where they lie).
        Either takes glob patterns for names ("*.mlp.gate.weight"), as split_rows does: an exact name wins, then
        the first pattern that matches; a pattern that matches nothing is an error.
    backend: "auto" | "fast" | "reference"; None reads NORMUON_BACKEND, then "auto" (= fast). No fallback.
    threads: the fast backend's threads; None (the default) follows torch.get_num_threads(), 0: one per
        processor the process may use, within its CPU quota.
        nonfinite: "error" | "skip_step".
    process_group: plain parameters that every rank of this torch.distributed group holds whole, with the
        same gradients (DDP): Newton-Schulz spread over the ranks, one owner per matrix (sharded.py), as
        for DTensor parameters (FSDP2, FSDP x TP), which need no argument. step() is then collective.
    verdict: on CUDA, when a step's NaN/Inf verdict reaches the host: "deferred" (the default: at the next step(),
        no host sync) or "sync" (in step(), one host sync); a bad step changes nothing on the device either way.
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
                 threads=None, nonfinite="error", verdict="deferred", process_group=None, split_rows=None, transposed=None,
                 _row_blocks=(),
                 _state_for_frozen=False, _device_backend=None, **knobs):
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
        if adamw_betas is not None and (not isinstance(adamw_betas, (tuple, list)) or len(adamw_betas) != 2):
            raise ValueError(f"adamw_betas={adamw_betas!r} is not a pair (beta1, beta2)")
        adamw_defaults = dict(lr=aw["lr"] if adamw_lr is None else adamw_lr,
                              betas=(aw["beta1"], aw["beta2"]) if adamw_betas is None else tuple(adamw_betas),
                              eps=aw["eps"] if adamw_eps is None else adamw_eps,
                              weight_decay=aw["weight_decay"] if adamw_weight_decay is None else adamw_weight_decay)
        self._choice = resolve_modes(backend, nonfinite, verdict)
        self.nonfinite = nonfinite
        self.verdict = verdict
        self._process_group = process_group
        self._device_backend = _device_backend
        # Frozen parameters (requires_grad=False, no gradient) get no state until they have a gradient.
        # The wrappers hand over tensors that are no autograd leaves (Megatron's main parameters, a rank's
        # shards): they lay out everything.
        self._state_for_frozen = _state_for_frozen
        # The Megatron adapter's split QKV: RowBlocks, each standing in the groups as its key tensor.
        self._row_blocks = {id(b.key): b for b in _row_blocks}
        params, roles, flips = resolve_inputs(params, normuon_params, adamw_params, model, roles, transposed)
        overrides = expand_patterns(dict(overrides or {}), param_names(params), "overrides")
        self._split_rows = dict(split_rows or {})
        self._transposed = dict(transposed or {})
        # What add_param_group needs later: the constructor's values for a new group, and the model to name
        # and route its tensors (a weak reference: the optimizer must not keep a model alive).
        self._defaults_by_algorithm = (normuon_defaults, adamw_defaults)
        self._model = weakref.ref(model if model is not None else params) \
            if isinstance(model if model is not None else params, torch.nn.Module) else None
        self._threads = threads
        groups, entries = plan_groups(params, normuon_defaults, adamw_defaults, overrides, roles, self._row_blocks,
                                      expand_patterns(self._split_rows, param_names(params), "split_rows"), flips)
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
        high = high_rank_by_rule(entries)
        if high:
            names = ", ".join(repr(e.name) for e in high[:4]) + (f" and {len(high) - 4} more" if len(high) > 4 else "")
            warnings.warn(f"NorMuonAdamW: {names} (3 or more dimensions) went to AdamW by the rule for such tensors: "
                          "outside an 'experts' module, names cannot tell a mixture-of-experts bank [E, m, n] (E "
                          "matrices, NorMuon's) from a conv kernel or a per-head weight. Say what they are and the "
                          "warning ends: roles= (e.g. {'*.moe.w_in': 'experts'}, {'*.conv*.weight': 'other'}) or "
                          "overrides=. The routing:\n" + self.routing_text(), stacklevel=2)

    # ------------------------------------------------------------------------------------------- building

    def _build(self, entries, keep=()):
        """The engine over the param groups as they are: checked values, layout, buffers, backend, and the
        state views. Frozen parameters are left out of the layout, unless their id is in `keep` (they had
        state)."""
        # Sharded (DTensors, or process_group=): everything laid out, as the wrappers do (one plan per rank).
        sharded = self._process_group is not None or is_sharded(entries)
        strided = [e.name for e in entries if sharded and not e.source.is_contiguous()]
        if strided:
            raise ValueError(f"parameters that are not contiguous ({', '.join(map(repr, strided[:3]))}) are not "
                             "served under sharded training (DTensors, or process_group=) yet: make them contiguous "
                             "first")
        frozen = [] if self._state_for_frozen or sharded else [
            e for e in entries if e.frozen and id(e.tensor) not in keep]
        left_out = {id(e) for e in frozen}
        self._betas_seen = [(g["beta1"], g["beta2"]) if g["algorithm"] == "normuon" else None
                            for g in self.param_groups]
        groups = [(g["name"], g["algorithm"], self._validated(i, g)) for i, g in enumerate(self.param_groups)]
        laid = [e for e in entries if id(e) not in left_out]
        # This rank's pieces and the matrices it owns (sharded.py).
        self._shards = Shards(laid, groups, self._process_group) if sharded else None
        self.engine = Engine(self._shards.entries if self._shards else laid, groups, self._choice,
                             threads=self._threads, nonfinite=self.nonfinite, verdict=self.verdict, frozen=frozen,
                             device_backend=self._device_backend)
        # The names the layout knows the parameters by (the caller's, or param0, group1.0, ... for bare tensors).
        self._name_of = {id(e.tensor): e.name for e in entries}
        # Each NorMuon group names its matrices stored [in, out]: an own key, so that a state dict (flattened by
        # torch.distributed.checkpoint too) carries what its second moments mean.
        self._flipped = {id(e.tensor) for e in entries if e.transposed}
        for g in self.param_groups:
            self._name_transposed(g)
        param_of = {e.index: e.tensor for e in entries}
        # What callers keep in opt.state under keys that are no parameters (torch keeps them, state dicts too).
        kept = {k: v for k, v in getattr(self, "state", {}).items() if not isinstance(k, torch.Tensor)}
        self.state = defaultdict(dict, kept)
        if self._shards is not None:
            self._shards.refresh(self.engine)  # the owners' whole matrices and their masters from the model
            for e in laid:  # every parameter has an entry, so torch's DCP helpers see state on every rank
                self.state[e.tensor] = {}
        for es in by_parameter(self.engine.entries).values():  # live views, for inspection as with torch's optimizers
            self.state[param_of[es[0].index]] = param_state(es, master=False)
        # The groups as built: a group appended to param_groups by hand is told by its absence (_adopt_hand_edits).
        self._built_groups = [(g, g["params"], len(g["params"])) for g in self.param_groups]

    def _name_transposed(self, g):
        """A NorMuon group's 'transposed': its matrices stored [in, out], by the names its state dict gives them."""
        if g["algorithm"] == "normuon":
            names = g.get("param_names") or self._names(g)
            g["transposed"] = [n for n, t in zip(names, g["params"]) if id(t) in self._flipped]

    def _names(self, group):
        """The layout's names of a group's parameters (its param_names are the caller's, and only when named)."""
        return [self._name_of[id(t)] for t in group["params"]]

    def _edited(self):
        """Whether param_groups differs from the groups as built (per group, not per parameter: cheap)."""
        return len(self.param_groups) != len(self._built_groups) or any(
            g is not b or g["params"] is not ps or len(ps) != n for g, (b, ps, n) in zip(self.param_groups,
                                                                                      self._built_groups))

    def _adopt_hand_edits(self, what):
        """torch.optim lets callers append to param_groups by hand; such groups are planned here as
        add_param_group plans them (all at once: nothing changes on an error). Any other edit of param_groups
        (a group removed, replaced or reordered, its 'params' changed) is refused with how to do it instead.
        Nothing to do (the check is per group, not per parameter: cheap) when param_groups is as built."""
        if not self._edited():
            return
        built = self._built_groups
        groups = self.param_groups
        if len(groups) < len(built) or any(g is not b for g, (b, _, _) in zip(groups, built)):
            raise ValueError(f"{what}: param_groups was edited by hand (a group removed, replaced or reordered); only "
                             "appending groups is supported (they are planned as add_param_group plans them). Build "
                             "a new optimizer for other groups (state_dict() carries the state over)")
        for i, (g, params, count) in enumerate(built):
            if g["params"] is not params or len(params) != count:
                raise ValueError(f"{what}: param_groups[{i}]['params'] was edited by hand; add parameters with "
                                 "add_param_group({'params': [...]}) (a new group, planned and routed as the "
                                 "constructor's), or build a new optimizer")
        if len(groups) > len(built):
            appended = groups[len(built):]
            del groups[len(built):]
            try:  # (a copy of a group here carries this optimizer's own keys: they are made anew)
                self._add_param_groups([{k: v for k, v in g.items() if k not in ("transposed", "step")}
                                        for g in appended])
            except (TypeError, ValueError, RuntimeError) as error:
                groups.extend(appended)  # as the caller left it
                message = f"{what}: param_groups[{len(built)}:] were appended by hand and are planned as " \
                          f"add_param_group plans them: {error}"
                try:
                    again = type(error)(message)
                except Exception:  # an exception type that takes other arguments: its base's
                    again = next(k for k in (TypeError, ValueError, RuntimeError) if isinstance(error, k))(message)
                raise again from None
            except BaseException:
                groups.extend(appended)
                raise

    def add_param_group(self, param_group):
        """torch's add_param_group (a layer unfrozen, a head added): a dict with "params" and, optionally,
        "name", "algorithm", "param_names" and hyper-parameters, as in the constructor ("auto" splits it by the
        routing rule; the model given to the constructor names and routes its tensors). The layout, buffers and
        backend are built again over every parameter: the parameters already here keep their state, masters
        and routing and the groups their step counters; the new group starts from zero. Nothing changes on
        an error."""
        if not getattr(self, "_built", False):  # torch's __init__ adds the constructor's groups
            return super().add_param_group(param_group)
        self._adopt_hand_edits("add_param_group")
        self._add_param_groups([param_group])

    def _add_param_groups(self, new_groups):
        self._not_sharded("add_param_group()")
        for param_group in new_groups:
            if not isinstance(param_group, dict) or "params" not in param_group:
                raise ValueError("add_param_group takes a dict with 'params' (and optionally 'name', 'algorithm' and "
                                 "hyper-parameters)")
            if "transposed" in param_group:
                raise ValueError("add_param_group: 'transposed' is the optimizer's own group key (which of the group's "
                                 "matrices are stored [in, out]): the model's modules say it, or the constructor's "
                                 "transposed=")
        self._sync_hyper()  # the current values of the existing groups, checked
        self._settle()
        self.engine.refresh_masters()
        kept, extra = [], {}
        for g in self.param_groups:
            keys = NORMUON_FIELDS if g["algorithm"] == "normuon" else ADAMW_KEYS
            kept.append(dict({k: g[k] for k in keys}, params=g["params"], names=self._names(g), name=g["name"],
                             algorithm=g["algorithm"]))
            # What schedulers and users keep in a group (initial_lr, max_lr, param_names ...) stays with it.
            extra[g["name"]] = {k: v for k, v in g.items() if k not in set(keys) | _GROUP_OWN_KEYS}
        model = self._model() if self._model is not None else None
        known = {"params", "names", "param_names", "name", "algorithm", "momentum", "betas"} | \
            set(NORMUON_FIELDS) | set(ADAMW_KEYS) | set(ADAMW_PREFIXED)
        added, roles, flips, new_extra = [], {}, {}, []
        for param_group in new_groups:
            group, r, f = resolve_inputs([{k: v for k, v in param_group.items() if k in known}], model=model)
            added += group
            roles.update(r)
            flips.update(f)
            new_extra.append({k: v for k, v in param_group.items() if k not in known})  # a scheduler's initial_lr
        old = {id(e.tensor): e for e in self.engine.entries + self.engine.frozen}
        # A router added now has its experts among the parameters already here.
        roles.update(router_roles([e.name for e in old.values()] + param_names(added)))
        roles.update({e.name: (e.role, e.evidence) for e in old.values()})
        names = [e.name for e in old.values()] + param_names(added)
        split = {n: p for n, p in expand_patterns(self._split_rows, names, "split_rows").items() if n in names}
        flips.update({n: (v, "transposed=") for n, v in expand_patterns(self._transposed, names, "transposed").items()})
        flips.update({e.name: (e.transposed, None) for e in old.values()})
        groups, entries = plan_groups(kept + added, *self._defaults_by_algorithm, {}, roles, self._row_blocks, split,
                                      flips)
        one_device(entries)
        for i, g in enumerate(groups):  # every value checked before anything is swapped
            self._validated(i, dict(g))
        named_here = all("param_names" in g for g in self.param_groups)
        for g in groups[len(kept):]:
            if ("param_names" in g) != named_here:  # torch's rule, on what the new group's names turn out to be
                raise ValueError("all optimizer param groups should be with/without names. cannot add param group "
                                 f"{'with' if 'param_names' in g else 'without'} names to the optimizer")
        for e in entries:
            if id(e.tensor) in old:  # routing as it was
                was = old[id(e.tensor)]
                e.role, e.evidence, e.why, e.override = was.role, was.evidence, was.why, was.override
        steps = {g["name"]: t for g, t in zip(self.param_groups, self.engine.steps)}
        before = {k: getattr(self, k) for k in _BUILT}  # torch's own checks and the rebuild may still refuse
        try:
            self.param_groups = []
            for g in groups:
                if g["name"] in extra:  # a group kept: its own keys (param_names as they were: the caller's)
                    g.pop("param_names", None)
                    g.update(extra[g["name"]])
                else:  # a new group (or a half of one): the caller's other keys
                    g.update(new_extra[_source_group(g, added, len(kept))])
                super().add_param_group(g)
            self._rebuild(entries, [steps.get(g["name"], 0) for g in self.param_groups])
        except BaseException:
            self.__dict__.update(before)  # as it was: nothing changed
            raise

    def _rebuild(self, entries, steps):
        """A new engine over `entries` (every parameter of param_groups): the parameters laid out before
        keep their state, masters and own counts (a new one starts at 0); steps: the group counters."""
        self._settle()  # a pending verdict and outside writes belong to the layout they were made on
        old = self.engine
        old.refresh_masters()
        self._build(entries, keep={id(e.tensor) for e in old.entries})
        self.engine.carry_from(old, steps)
        self._publish_steps()

    def _unfreeze_if_needed(self):
        """Frozen parameters that now have a gradient are laid out (state from zero), as torch's optimizers
        start a parameter's state at its first gradient. One native call finds them."""
        if self.engine.frozen_with_grad():
            self._rebuild(sorted(self.engine.entries + self.engine.frozen, key=lambda e: e.index),
                          list(self.engine.steps))

    # ------------------------------------------------------------------------------ hyper-parameters

    def _validated(self, i, group, seen=None):
        """The group's hyper-parameters in the spec's field names, checked; ValueError names the group.
        seen: a NorMuon group's (beta1, beta2) as last read, to tell which of its two forms changed."""
        try:
            if group["algorithm"] == "normuon":
                _normuon_betas(group, seen)
                raw = {k: group[k] for k in NORMUON_FIELDS}
            else:
                betas = group["betas"]
                if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                    raise ValueError(f"betas={group['betas']!r} is not a pair")
                raw = dict(lr=group["lr"], beta1=betas[0], beta2=betas[1], eps=group["eps"],
                           weight_decay=group["weight_decay"])
            values = check_values(group.get("name", f"group{i}"), group["algorithm"], raw)
        except KeyError as missing:
            raise ValueError(f"param_groups[{i}] ('{group.get('name')}'): missing key {missing}") from None
        except (TypeError, ValueError) as error:  # a value of the wrong type, shape or range: the group and field
            raise ValueError(f"param_groups[{i}] ('{group.get('name')}', {group['algorithm']}): {error}") from None
        return values

    def _sync_hyper(self):
        """Reads every group's values (schedulers change them between steps) into the engine."""
        self.engine.set_nonfinite(self.nonfinite)
        hypers = [self._validated(i, g, self._betas_seen[i]) for i, g in enumerate(self.param_groups)]
        self._betas_seen = [(g["beta1"], g["beta2"]) if g["algorithm"] == "normuon" else None
                            for g in self.param_groups]
        self.engine.set_values(hypers)

    def _reconcile_betas(self):
        """Both forms of every NorMuon group's pair agree again (as the next step would make them)."""
        for i, (g, _, _) in enumerate(self._built_groups):
            if g["algorithm"] == "normuon":
                self._betas_seen[i] = _normuon_betas(g, self._betas_seen[i])

    def _publish_steps(self):
        """group['step'] from the engine's counters: no copy kept by hand."""
        for (g, _, _), t in zip(self._built_groups, self.engine.steps):
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
        self._adopt_hand_edits("step()")
        self._sync_hyper()
        if self.engine.frozen:
            self._unfreeze_if_needed()
        scaler = self._scaler(kwargs.get("grad_scaler"))
        try:
            if self._shards is None:
                self.last_skip_reason = self.engine.step(scaler)
            elif scaler is not None:
                raise RuntimeError("a gradient scaler with sharded parameters (DTensors, or process_group=) is not "
                                   "served yet: unscale and check the gradients yourself, or train in bf16 without "
                                   "a scaler")
            else:
                self.last_skip_reason = self._shards.step(self.engine, self.nonfinite)
        finally:  # a deferred verdict raised here has rolled the counters back
            self._publish_steps()
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
            return None, torch.tensor(found, dtype=torch.float32, device=self.engine.device)
        scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        if found_inf is None:
            if scale is not None:
                raise ValueError("a gradient scaler handed over grad_scale without found_inf")
            return None
        found_inf = found_inf.detach().to(device=self.engine.device, dtype=torch.float32).reshape(()).contiguous()
        if scale is not None:
            scale = scale.detach().to(device=self.engine.device, dtype=torch.float32).reshape(()).contiguous()
            if self.engine.device.type == "cpu" and not (math.isfinite(float(scale)) and float(scale) > 0):
                raise ValueError(f"the gradient scaler's scale {float(scale)!r} is not finite and > 0")
        return scale, found_inf

    def _not_sharded(self, what):
        if self._shards is not None:
            raise RuntimeError(f"NorMuonAdamW.{what} over sharded parameters (DTensors, or process_group=) is not "
                               "served yet: build a new optimizer over every group (state_dict() carries the state "
                               "over)")

    def _settle(self):
        """verdict='deferred': the pending step's verdict now (the next step(), state_dict, state files), so
        the counters are final. Returns the reason that step was skipped, or None; raises as step() would
        under nonfinite='error'. That step changed nothing, its counters included."""
        try:
            reason = self.engine.settle()
        finally:
            self._publish_steps()
        if reason is not None:
            self.last_skip_reason = reason
        return reason

    # ----------------------------------------------------------------------------------- inspection

    @property
    def backend(self):
        """Which backend runs the steps: 'fast-cpu', 'fast-cuda' or 'reference-cpu'."""
        return self.engine.backend

    def memory_report(self):
        """Bytes the optimizer holds beyond the model's tensors: state_bytes (momentum, second moments,
        exp_avg, exp_avg_sq), master_bytes (fp32 masters of bf16/fp16 parameters: 4 B per element) and
        workspace_bytes (the native backend's Newton-Schulz buffers and scratch; for the reference, only its
        working copies of blocks of rows)."""
        return self.engine.memory_report()

    @property
    def comm_stats(self):
        """Over sharded parameters: what this rank sent and received through torch.distributed, in all
        ({steps, collectives, bytes_sent, bytes_received}); None in one process. last_step_comm: the last step."""
        return None if self._shards is None else self._shards.comm_stats

    @property
    def last_step_comm(self):
        return None if self._shards is None else self._shards.last_step_comm

    @property
    def layout(self):
        """The C++ Layout (normuon._C.Layout): placement, buckets, fingerprint."""
        return self.engine.layout

    def routing_table(self):
        """One row per parameter (manifest order): which algorithm and group it got, and why; sharded, also
        its owner (ownership_table)."""
        frozen = {id(e) for e in self.engine.frozen}
        entries = self._shards.planned if self._shards is not None else self.engine.entries + self.engine.frozen
        entries = [es[0] for es in by_parameter(entries).values()]  # a bank's experts: one row
        owners = {r["index"]: r["owner"] for r in self.ownership_table() or ()}
        return [dict(index=e.index, name=e.name, shape=tuple(e.block.param_shape if is_piece(e) else e.shape),
                     dtype=DTYPES[e.dtype], role=e.role, transposed=e.transposed,
                     algorithm=e.algorithm, group=self.param_groups[e.group]["name"],
                     why=e.why + (" (frozen: no state until it has a gradient)" if id(e) in frozen else ""),
                     stats=("" if e.algorithm == "adamw" or id(e) in frozen else "rows" if e.stats_per_row else "cols"),
                     **({"owner": owners[e.index]} if owners else {}))
                for e in sorted(entries, key=lambda e: e.index)]

    def routing_text(self):
        tail = f"backend {self.backend}; layout {self.engine.layout.fingerprint}"
        if self._shards is None:
            return routing_text(type(self).__name__, self.routing_table(), tail)
        return routing_text(type(self).__name__, self.routing_table(),
                            f"{self._shards.world} ranks, this one {self._shards.rank}; " + tail,
                            ROUTING_COLUMNS[:-1] + ("owner", "why"))

    def ownership_table(self):
        """Sharded: one row per parameter (manifest order) with its owner, the rank that runs a matrix's
        Newton-Schulz and sends its new values ('all': every rank steps its own piece, AdamW), and its cost
        (Newton-Schulz FLOPs, or elements). None in one process."""
        return None if self._shards is None else self._shards.ownership()

    def print_routing(self, file=None):
        print(self.routing_text(), file=file)

    def manifest_csv(self):
        """The C++ manifest of this optimizer (name,shape,dtype,role,group,algorithm) as CSV text."""
        return self.engine.manifest.to_csv()

    def write_manifest(self, path):
        """Writes the manifest, for `normuon run --manifest PATH` / `normuon layout --manifest PATH`."""
        self.engine.manifest.write_csv(os.fspath(path))

    # ----------------------------------------------------------------------------------- state dicts

    def state_dict(self):
        """torch's structure: "state" by parameter index (param_groups order) with fp32 copies of
        momentum_buffer + moment2_buffer (NorMuon; moment2 is the reduced second moment, length rows or
        cols) or exp_avg + exp_avg_sq (AdamW), plus master_param for non-fp32 parameters and, as torch's
        AdamW, 'step': the parameter's own count (a 0-d fp32 tensor: the steps it had a gradient in, which
        its AdamW bias corrections use); "param_groups" with the hyper-parameters, names and the group's
        step. torch's state-dict hooks (torch >= 2.1:
        register_state_dict_pre_hook / _post_hook) run around it as around torch's own. Over DTensor
        parameters (collective): each state tensor a DTensor laid out as its parameter, as torch's optimizers
        have it under FSDP2, for torch.distributed.checkpoint (resharded on load)."""
        for hook in list(getattr(self, "_optimizer_state_dict_pre_hooks", {}).values()):
            hook(self)
        try:  # groups appended by hand: planned as a step would plan them, where they can be
            self._adopt_hand_edits("state_dict")
        except (TypeError, ValueError, RuntimeError):
            pass  # (a repeated group, ...): saved as torch saves it; the next step() refuses it
        if self._shards is None:
            self.engine.refresh_masters()
        else:  # (collective) the owners' whole matrices first: a bf16 matrix's master is read at its owner
            self._shards.refresh(self.engine)
        self._settle()
        self._reconcile_betas()  # a scheduler may have moved betas since the last step
        if self._shards is not None:
            sh = self._shards
            pieces = sh.local_state(self.engine)
            by_tensor = {id(e.tensor): (sh.dtensors(i, pieces[i]), sh.entry_steps[i]) for i, e in enumerate(sh.planned)}
        else:
            by_tensor = {}
            own = dict(zip(map(id, self.engine.entries), self.engine.entry_steps))
            for t, es in by_parameter(self.engine.entries).items():  # a bank's experts step together
                by_tensor[t] = {k: v.clone(memory_format=torch.contiguous_format)
                                for k, v in param_state(es).items()}, own[id(es[0])]
        # As torch's: parameters numbered in param_groups order, a parameter repeated (a group appended by hand and
        # not stepped yet) keeps its first number; keys of opt.state that are no parameters kept as they are.
        groups, state, index = [], {}, {}
        for g in self.param_groups:
            packed = {k: (list(v) if isinstance(v, list) else v) for k, v in g.items() if k != "params"}
            for t in g["params"]:
                if id(t) not in index:
                    index[id(t)] = len(index)
                    if id(t) in by_tensor:  # (frozen: no state, as torch has none for a parameter never stepped)
                        s, own = by_tensor[id(t)]
                        state[index[id(t)]] = dict(s, step=torch.tensor(float(own)))
            packed["params"] = [index[id(t)] for t in g["params"]]
            groups.append(packed)
        state.update({k: v for k, v in self.state.items() if not isinstance(k, torch.Tensor)})
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
        self._adopt_hand_edits("load_state_dict")
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise ValueError("not a NorMuonAdamW state dict: expected the keys 'state' and 'param_groups'")
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        if len(saved_groups) > len(self.param_groups):  # earlier versions kept a split's empty half: it holds nothing
            here = {g["name"] for g in self.param_groups}
            saved_groups = [sg for sg in saved_groups if sg.get("params") or sg.get("name") in here]
        hint = self._routing_hint(saved_groups)
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(saved_groups)} param groups, this optimizer "
                             f"{len(self.param_groups)} ({', '.join(g['name'] for g in self.param_groups)}){hint}")
        sh = self._shards
        by_tensor = by_parameter(sh.planned if sh is not None else self.engine.entries)
        writes, new_groups, steps, own_steps = [], [], [], {}
        position = {id(e.tensor): i for i, e in enumerate(sh.planned)} if sh is not None else {}
        pieces = [dict() for _ in position]  # sharded: this rank's piece of each parameter's state
        for i, (sg, g) in enumerate(zip(saved_groups, self.param_groups)):
            where = f"param_groups[{i}] ('{g['name']}')"
            if sg.get("algorithm", g["algorithm"]) != g["algorithm"]:
                raise ValueError(f"{where}: saved as a {sg.get('algorithm')} group, this one is {g['algorithm']}")
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(f"{where}: {len(sg['params'])} parameters saved, {len(g['params'])} here{hint}")
            # Names decide when both sides have them (routing follows names); else the parameters load by position.
            saved_names, here_names = _saved_names(sg), g.get("param_names")
            if saved_names is not None and here_names is not None:
                diff = next((f"'{a}' saved vs '{b}' here" for a, b in zip(saved_names, here_names)
                             if strip_wrappers(a) != strip_wrappers(b)), None)
                if diff:
                    raise ValueError(f"{where}: parameter names differ ({diff}); a state dict of other names loads "
                                     "by position into an optimizer of bare tensors (model.parameters())")
            _same_transposition(where, self._saved_transposed(where, sg, saved_names, g),
                                [n for n, t in zip(self._names(g), g["params"]) if id(t) in self._flipped])
            # A group's counter; a torch optimizer's state dict keeps none: its parameters' most steps, then.
            step = sg["step"] if "step" in sg else max(
                [_own_step(saved_state[i]["step"], math.inf, f"parameter {i}") for i in sg["params"]
                 if "step" in saved_state.get(i, {})] or [0])
            if not isinstance(step, int) or step < 0:
                raise ValueError(f"{where}: step={step!r} is not a non-negative integer")
            steps.append(step)
            new = {k: v for k, v in sg.items() if k not in ("params", "transposed", "names", "param_names")}
            new["params"], new["name"], new["algorithm"] = g["params"], g["name"], g["algorithm"]
            if here_names is not None or saved_names is not None:  # torch's rule: the state dict's, else ours
                new["param_names"] = list(saved_names if saved_names is not None else here_names)
            self._validated(i, new)
            for k in self.engine.fixed_keys:
                if k in new and new[k] != g[k]:
                    raise ValueError(f"{where}: {k} is {new[k]!r} in the state dict but {g[k]!r} here (it decides "
                                     f"the {'layout' if k in _C.layout_fields() else 'backend plan'})")
            new_groups.append(new)
            for k, (idx, t) in enumerate(zip(sg["params"], g["params"])):
                if id(t) not in by_tensor:  # frozen here
                    if saved_state.get(idx):
                        raise ValueError(f"{where}: the state dict has state for parameter '{self._names(g)[k]}', "
                                         "which was frozen when this optimizer was built (requires_grad=False, no "
                                         "gradient: no state): make it trainable before building the optimizer")
                    continue
                e = by_tensor[id(t)][0]
                # What one process holds for it: {key: a tensor of that shape} (sharded: the whole shape).
                held = ({k: torch.empty(shape, device="meta") for k, shape, _ in sh.state_layout(position[id(t)])}
                        if sh is not None else param_state(by_tensor[id(t)]))
                s = saved_state.get(idx)
                if s is None:
                    s = {k: torch.zeros(v.shape) for k, v in held.items() if k != "master_param"}  # never stepped
                    s["step"] = 0
                # The parameter's own count; a state dict without one (saved before counts were kept) means
                # the group's, which is what its bias corrections used then.
                s = dict(s)
                own_steps[id(e.tensor)] = _own_step(s.pop("step", step), step, f"parameter '{e.name}'")
                expected = {k: v for k, v in held.items() if k != "master_param" or "master_param" in s}
                if set(s) != set(expected):
                    raise ValueError(f"state of parameter '{e.name}' ({e.algorithm}) has keys {sorted(s)}, "
                                     f"expected {sorted(expected)}")
                for k, dst in expected.items():
                    src = s[k]
                    if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(dst.shape):
                        got = tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
                        raise ValueError(f"state '{k}' of parameter '{e.name}' has shape {got}, expected "
                                         f"{tuple(dst.shape)}{hint}")
                    if not src.is_floating_point():
                        raise ValueError(f"state '{k}' of parameter '{e.name}' is {src.dtype}, not floating point")
                    if sh is not None:
                        pieces[position[id(t)]][k] = src
                    else:
                        writes.append((dst, src))
        if sh is not None:  # collective: every rank's pieces to where its engine holds them
            sh.refresh(self.engine)
            sh.load_local_state(self.engine, [sh.local_pieces(i, p) for i, p in enumerate(pieces)], steps,
                                [own_steps[id(e.tensor)] for e in sh.planned])
        for dst, src in writes:
            dst.copy_(src)
        self.engine.mark_current()  # the masters just loaded win over the model's values as they are now
        for g, new in zip(self.param_groups, new_groups):
            g.clear()
            g.update(new)
            self._name_transposed(g)
        # torch's: opt.state is the state dict's, keys that are no parameters included (those here go)
        indices = {i for sg in saved_groups for i in sg["params"]}
        for k in [k for k in self.state if not isinstance(k, torch.Tensor)]:
            del self.state[k]
        self.state.update({k: v for k, v in saved_state.items() if k not in indices})
        if sh is None:
            self.engine.set_steps(steps, [own_steps[id(e.tensor)] for e in self.engine.entries])
        self._publish_steps()
        self._sync_hyper()

    def _routing_hint(self, saved_groups):
        """Why a state dict saved with names loads into bare tensors' groups (or back) that differ, and what makes
        them match; empty when both sides are named alike."""
        saved_named = any(_saved_names(sg) is not None for sg in saved_groups)
        here_named = any("param_names" in g for g in self.param_groups)
        if saved_named == here_named:
            return ""
        which = {True: "named parameters (a model, named_parameters())", False: "bare tensors (model.parameters())"}
        return (f". The state dict was saved by an optimizer of {which[saved_named]}, this one is of "
                f"{which[here_named]}: bare tensors are routed by their shapes alone (every matrix to NorMuon), a "
                "model's parameters by its modules (the embeddings and the output head to AdamW), so the groups can "
                "differ. Build both alike: NorMuonAdamW(model) on both sides, or pass model=model beside "
                "model.parameters()")

    def _saved_transposed(self, where, sg, saved_names, g):
        """A saved NorMuon group's matrices stored [in, out], under this group's names (by position, where names
        differ or are missing)."""
        saved = list(sg.get("transposed", ()))
        if not saved:
            return []
        names = saved_names if saved_names is not None else sg.get("names")
        if names is None or len(names) != len(g["params"]):
            raise ValueError(f"{where}: the state dict holds matrices stored [in, out] ({', '.join(saved[:3])}) but "
                             "no names to tell which they are: save it from an optimizer of named parameters")
        marked = set(map(strip_wrappers, saved))
        return [n for n, s in zip(self._names(g), names) if strip_wrappers(s) in marked]

    # ----------------------------------------------------------------------------------- state files

    def export_state(self, path):
        """Writes the project's state file (docs/layout-and-state.md): fp32 master parameters, state,
        group steps and hyper-parameters. `normuon inspect PATH` reads it, `normuon run --load` resumes it.
        Sharded (collective): the one-process file, written by rank 0 from every rank's pieces."""
        self._adopt_hand_edits("export_state")
        self._sync_hyper()
        if self._shards is None:
            self.engine.save(os.fspath(path), self.backend)
            return
        whole, error = self._whole_engine()[0], None  # (collective; rank 0's alone)
        if whole is not None:
            try:
                whole.save(os.fspath(path), self.backend)
            except Exception as exc:  # every rank raises it
                error = f"{type(exc).__name__}: {exc}"
        failed = self._shards.agree(error)
        if failed is not None:
            raise RuntimeError(f"rank {failed[0]} could not write the state file {os.fspath(path)}: {failed[1]}")

    def _whole_engine(self, filled=True):
        """Sharded: (a one-process reference engine over whole CPU copies of the parameters, the position in
        the sharded plan of each of its entries), laid out as one process lays them out: the state file's
        layout, where a frozen parameter that never had a gradient has no place. filled (collective): with the
        whole state, masters and counters, built on rank 0 alone (None elsewhere); else zeros, on every rank."""
        sh = self._shards
        if filled:
            sh.refresh(self.engine)
            self._settle()
            pieces = sh.local_state(self.engine)
        keep = not filled or sh.rank == 0
        laid, frozen, states = [], [], []
        for i, e in enumerate(sh.planned):
            if filled:  # (a DTensor's whole values: collective, on every rank)
                values = sh.whole(e.tensor.detach())
                state = {k: sh.whole(v) for k, v in sh.dtensors(i, pieces[i]).items()}
            if not keep:
                continue
            w = copy.copy(e)
            w.tensor = values.to("cpu", copy=True) if filled else torch.zeros(e.shape, dtype=e.dtype)
            w.grad_of = None
            if e.frozen and sh.entry_steps[i] == 0:
                frozen.append(w)
            else:
                laid.append((i, w))
                states.append(state if filled else None)
        if not keep:
            return None, None
        whole = Engine([w for _, w in laid], [(n, g["algorithm"], v) for n, g, v in
                                              zip(self.engine.group_names, self.param_groups, self.engine.values)],
                       "reference", frozen=frozen)
        if filled:
            for ws, state in zip(by_parameter(whole.entries).values(), states):  # (a bank: its experts)
                for key, dst in param_state(ws).items():
                    dst.copy_(state[key])
            whole.mark_current()
            whole.set_steps(sh.steps, [sh.entry_steps[i] for i, _ in laid for _ in sh.spans[i]])
        return whole, [i for i, _ in laid]

    def import_state(self, path):
        """Loads a state file of this layout (written by export_state or `normuon run --save`): all or nothing
        (StateFileError). Sets the optimizer state, group steps and hyper-parameters (not nonfinite, not
        reduce_axis), and the model's parameters from the file's fp32 values. Sharded (collective): every rank
        reads the file (a path they all reach) and takes its pieces; a rank that cannot read it makes every
        rank raise, nothing changed."""
        path = os.fspath(path)
        self._settle()  # as load_state_dict
        self._adopt_hand_edits("import_state")
        target, positions = (self.engine, None) if self._shards is None else self._whole_engine(filled=False)
        try:
            flat, updated = self._read_state_file(path, target)
            error = None
        except Exception as exc:
            if self._shards is None:
                raise
            flat, updated, error = None, None, exc
        if self._shards is not None:  # every rank's outcome, before any collective that moves state
            failed = self._shards.agree(None if error is None else f"{type(error).__name__}: {error}")
            if error is not None:
                raise error
            if failed is not None:
                raise RuntimeError(f"rank {failed[0]} could not load the state file {path}: {failed[1]} (nothing "
                                   "was changed)")
        target.from_flat(flat)  # the group steps too
        if self._shards is not None:
            self._shards.load_whole(self.engine, target, positions)
        self._publish_steps()
        for g, new in zip(self.param_groups, updated):
            g.update({k: v for k, v in new.items() if k not in ("params", "names", "name", "algorithm", "step")})
        self._sync_hyper()

    def _read_state_file(self, path, target):
        """The file read into a scratch FlatState of `target`'s layout, every saved value checked as a step
        would check it: (the flat state, each group's values as they will be). Nothing changes here."""
        contents = _C.read_state_file(path)  # one read: the header looked at and the tensors are one version
        try:
            flat = _C.FlatState(target.file_layout(contents.header))
        except ValueError as error:  # an expert bank saved whole, matrices by their stored rows
            raise ValueError(f"{path}: {error}") from None
        saved = _C.load_state_file(contents, flat)  # all or nothing, into a scratch state
        # What the layout and the CUDA plan fixed, and each group's values as a step would check them (a file
        # with ns_steps=0 changed the state first).
        updated = []
        for i, g in enumerate(self.param_groups):
            h = saved.hyper(i)
            if g["algorithm"] == "adamw":
                new = dict(g, lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], weight_decay=h["weight_decay"])
            else:
                new = dict(g, **{k: v for k, v in h.items() if k not in _C.layout_fields()})
                new.pop("betas", None)  # follows beta1 / beta2
            try:
                self._validated(i, new)
            except ValueError as error:
                raise ValueError(f"{path}: {error}") from None
            if g["algorithm"] == "normuon":
                file_values = {k: h[k] for k in self.engine.fixed_keys if k in h}  # checked by the core as read
                bad = [k for k, v in file_values.items() if v != self.engine.fixed[i][k]]
                if bad:
                    raise ValueError(f"{path}: group '{g['name']}' was saved with "
                                     + ", ".join(f"{k}={h[k]!r}" for k in bad) + ", but this optimizer was built "
                                     "with " + ", ".join(f"{k}={self.engine.fixed[i][k]!r}" for k in bad))
            updated.append(new)
        return flat, updated


_GROUP_OWN_KEYS = {"params", "names", "name", "algorithm", "step", "betas", "transposed"}  # the optimizer's own keys
# What building the engine sets (_build): put back as it was when a rebuild is refused.
_BUILT = ("param_groups", "_betas_seen", "_built_groups", "engine", "state", "_name_of", "_flipped", "_shards")


_GENERATED_NAME = re.compile(r"(param\d+|group\d+\.\d+)")


def _saved_names(sg):
    """A saved group's parameter names: param_names, or the key earlier versions wrote ('names', which held
    generated names, param0 or group1.0, for bare tensors: those count as none); None without names."""
    if "param_names" in sg:
        return list(sg["param_names"])
    names = sg.get("names")
    if names is None or all(_GENERATED_NAME.fullmatch(n) for n in names):
        return None
    return list(names)


def _source_group(planned, given, first):
    """The index in `given` (param groups as resolve_inputs returns them, numbered from `first` by plan_groups)
    of the group a planned group came from: the one holding its first tensor, or, for an empty group, the one
    plan_groups named so."""
    for j, ug in enumerate(given):
        ps = [ug["params"]] if isinstance(ug["params"], torch.Tensor) else ug["params"]
        tensors = [p[1] if isinstance(p, (tuple, list)) else p for p in ps]
        if planned["params"] and any(t is planned["params"][0] for t in tensors):
            return j
        if not planned["params"] and planned["name"] == ug.get("name", f"group{first + j}"):
            return j
    raise AssertionError(f"planned group '{planned['name']}' comes from no group given")


def _same_transposition(where, saved, here):
    """A NorMuon group's matrices stored [in, out] in a state dict (none: saved before they were, or with
    transposed={'*': False}) and here, by name without wrapper prefixes: ValueError when they differ, since their
    second moments run along the other axis, with the transposed= that loads it."""
    saved_set, here_set = set(map(strip_wrappers, saved)), set(map(strip_wrappers, here))
    differ = [n for n in here if strip_wrappers(n) not in saved_set] + \
        [n for n in saved if strip_wrappers(n) not in here_set]
    if not differ:
        return
    shown = ", ".join(f"'{n}'" for n in differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
    if not saved:
        how = "transposed={'*': False}"
    elif not here:
        how = "the modules' reading (no transposed={'*': False}) or transposed={name: True} for those saved so"
    else:
        how = "the transposed= it was saved with"
    raise ValueError(f"{where}: the state dict holds {'no' if not saved else len(saved)} matrices stored [in, out] "
                     f"(transposed), this optimizer {len(here)}; {shown} differ, and their second moments run along "
                     f"the other axis: build the optimizer with {how} to load it")


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
