"""The native engine bound to a model's tensors: what every optimizer of this package is a client of.

NorMuonAdamW, MegatronNorMuon and MegatronAdamW each own one Engine, and build a new one when their
parameters change (a group added, a layer unfrozen, Megatron's tensor swaps); `carry_from` moves over what
the parameters kept had. An Engine holds the native engine (normuon._C.Engine: layout, checked values,
state, every counter and the backend: fast on the CPU or a CUDA device, or the reference on the CPU) and
per-parameter views of its buffers (entry.state, entry.master).
It knows parameters and group indices only: param_groups, state dicts and their forms are its clients'.
"""
import contextlib
import copy

import torch

from .native import _C, cuda_module, require
from .plan import DTYPES, is_bank
from .routing import strip_wrappers
from .row_blocks import pieces

FOUND_INF_REASON = _C.FOUND_INF_REASON if _C is not None else None  # the core's words


class Engine:
    """entries: the planned parameters (plan.py) to lay out, each with its group index; groups: one
    (name, algorithm, values) per group, values in the spec's field names and canonical types
    (check_values); choice: the resolved backend choice ('fast' | 'reference'); threads: the fast CPU
    backend's (None: follow torch.get_num_threads()); frozen: planned parameters left out until they have
    a gradient; device_backend: a device backend from another native module (the tests' emulated CUDA
    engine). ValueError when the backend cannot serve the request (no fallback)."""

    def __init__(self, entries, groups, choice, *, threads=None, nonfinite="error", verdict="sync", frozen=(),
                 device_backend=None):
        device = one_device(list(entries) + list(frozen))
        # Its own copies of the planned entries: the views carved below are this engine's, and an engine
        # built later over the same parameters leaves them as they are (carry_from reads them).
        self.device = device
        self.entries = [x for e in entries for x in laid_out(e)]
        self.frozen = [copy.copy(e) for e in frozen]
        self.group_names = [name for name, _, _ in groups]
        self.values = [dict(values) for _, _, values in groups]  # as the backend has them
        self._choice, self._threads, self._device_backend = choice, threads, device_backend
        self.nonfinite = nonfinite
        self.options = _C.Options([(name, algorithm) for name, algorithm, _ in groups])
        for i, values in enumerate(self.values):
            self.options.set_group(i, values)
        self.options.set("nonfinite", nonfinite)
        self.manifest = _C.Manifest(self.specs())
        buffers = self._allocate_native(verdict)
        self.fixed_keys = tuple(self._native.fixed_fields)
        self.fixed = [{k: v[k] for k in self.fixed_keys if k in v} for v in self.values]
        for e, le in zip(self.entries, self.layout.entries):  # the second-moment axis, as the caller's shape has it
            e.stats_per_row, e.stat_len = le.stats_per_row != swapped(e), le.stat_len
        self._carve(buffers)
        for es in by_parameter(self.entries).values():  # a split matrix's state must read back whole: else refused
            if is_piece(es[0]) and es[0].block.parts > 1:
                param_state(es)
        self.refresh_masters()  # the fp32 masters of bf16/fp16 parameters: the only copy made of the model

    # --------------------------------------------------------------------------------------- building

    def specs(self, names=None):
        """The C++ manifest's rows (ParamSpec), under other parameter names if given."""
        return param_specs(self.entries, self.group_names, names)

    def _allocate_native(self, verdict):
        """The native engine over the model's own tensors (table mode): the fast CPU backend, the fast CUDA
        one on the parameters' device (its buffers in device memory viewed zero-copy), or the reference."""
        where = f"backend '{self._choice}' on {self.device}"
        no_fallback = "no fallback to another device or the reference; ask for backend='reference' explicitly"
        index = -1 if self.device.type == "cpu" else self.device.index
        if self._choice == "reference":
            if index >= 0:
                raise ValueError(f"{where}: the reference steps CPU tensors here (reference-cpu; its bits are the "
                                 "spec's on every device, docs/reference.md): move the model to the CPU to compare "
                                 "against it, or choose backend='fast'")
            backend = None
        elif self._device_backend is not None:
            backend = (self._device_backend, index)
        elif self.device.type == "cpu":
            if not _C.has_fast_cpu:  # _C built without oneDNN (-DNORMUON_BUILD_FAST_CPU=OFF)
                raise RuntimeError(f"{where} needs the fast CPU backend, which this build of normuon._C does not "
                                   f"have (configured without oneDNN, -DNORMUON_BUILD_FAST_CPU=OFF); {no_fallback}, "
                                   "put the parameters on a CUDA device, or rebuild with oneDNN")
            # threads=None follows torch's setting (several ranks per node share the cores as torch does).
            backend = (torch.get_num_threads() if self._threads is None else self._threads,)
        else:
            cuda, why = cuda_module()
            if cuda is None:
                raise ValueError(f"{where}: {why} ({no_fallback})")
            backend = (cuda.engine_backend(index, self.stream()), index)
        try:
            with (torch.cuda.device(self.device) if index >= 0 else contextlib.nullcontext()):
                native = (_C.Engine.reference(self.manifest, self.options) if backend is None else
                          _C.Engine(self.manifest, self.options, *backend))
        except ValueError as error:
            raise ValueError(f"{where} cannot serve this request: {error} ({no_fallback})") from None
        native.verdict = verdict
        self._native = native
        self.layout = native.layout
        blocks = [(0, 0, 0) if e.block is None else (e.block.offset, *e.block.runs) for e in self.entries]
        inside = any(e.block is not None for e in self.entries)  # blocks of rows, a bank's experts: (offset, runs)
        grad_of = [e.grad_of for e in self.entries] if any(e.grad_of is not None for e in self.entries) else []
        # A tensor neither contiguous nor dense is stepped through a contiguous copy of it (its shadow), which the
        # native step reads from it and writes back (one per tensor: a bank's experts share theirs).
        shadows = {}
        for e in self.entries:
            if e.staged and id(e.source) not in shadows:
                shadows[id(e.source)] = (torch.empty(e.source.shape, dtype=e.source.dtype, device=e.source.device),
                                         e.source)
        native.bind([shadows[id(e.source)][0] if e.staged else e.source for e in self.entries],
                    blocks if inside else [], [e.tensor for e in self.frozen], grad_of, list(shadows.values()))
        return {k: torch.from_numpy(v) if not isinstance(v, tuple) else _device_view(native, *v, self.device)
                for k, v in native.buffers().items()}

    def _carve(self, buffers):
        """Per-entry views of the buffers (host or device): e.state (the two state tensors of its
        algorithm, in the layout's forms) and e.master."""
        self.buffers = buffers  # masters, momentum, row_var, exp_avg, exp_avg_sq
        for e, le in zip(self.entries, self.layout.entries):
            if e.algorithm == "normuon":
                e.state = (caller_view(e, buffers["momentum"][le.offset:le.offset + le.numel]),
                           buffers["row_var"][le.stat_offset:le.stat_offset + le.stat_len])
            else:
                adam = slice(le.adam_offset, le.adam_offset + le.numel)
                e.state = (caller_view(e, buffers["exp_avg"][adam]), caller_view(e, buffers["exp_avg_sq"][adam]))
            e.master = (caller_view(e, buffers["masters"][le.master_offset:le.master_offset + le.numel])
                        if e.low_precision else None)

    def carry_from(self, old, steps):
        """The re-layout path: the parameters `old` also laid out (the same tensor, the same block of rows)
        keep their state, fp32 masters (with their low bits) and own counts (a new one starts at 0);
        steps: the group counters. Callers settle `old` first (its pending verdict is theirs), and refresh
        its masters where outside writes should count."""
        before = {_key(e): (e, t) for e, t in zip(old.entries, old.entry_steps)}
        counts = []
        for e in self.entries:
            was, count = before.get(_key(e), (None, 0))
            counts.append(min(count, steps[e.group]))  # never past its (new) group's counter
            if was is None or was.algorithm != e.algorithm or was.shape != e.shape:
                continue
            for dst, src in zip(e.state, was.state):
                dst.copy_(src)
            if e.low_precision and was.low_precision:
                e.master.copy_(was.master)
        self.mark_current()
        self.set_steps(steps, counts)

    # -------------------------------------------------------------------------------- values, counters

    def set_values(self, values):
        """Each group's checked values, where they changed since the last call; a field the layout or the
        backend's plan was built from (fixed_keys) may not change (ValueError, nothing changed)."""
        for i, v in enumerate(values):
            if self.values[i] != v:
                self._native.set_group(i, v)
                self.values[i] = dict(v)

    def set_nonfinite(self, policy):
        resolve_modes("reference", policy, "sync")  # checked by the core, before anything changes
        self.nonfinite = policy
        self._native.set_nonfinite(policy)

    @property
    def steps(self):
        """The group counters: the native engine's (read, never copied)."""
        return self._native.group_steps

    @property
    def entry_steps(self):
        """Each parameter's own count (the steps it had a gradient in)."""
        return self._native.entry_steps

    def set_steps(self, steps, entry_steps=None):
        """Group counters and the parameters' own counts (None: each at its group's counter, what state of
        format version 1 means), checked first; a device's copy follows. Callers settle first."""
        self._native.set_steps([int(t) for t in steps], None if entry_steps is None else [int(t) for t in entry_steps])

    # ------------------------------------------------------------------------------------------- steps

    def stream(self):
        """Where device work goes: the caller's current stream on CUDA (a handle; 0 is torch's default, the
        legacy stream), None on the CPU."""
        return torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else None

    def step(self, scaler=None):
        """One step over every parameter with a gradient. scaler: (scale or None, found_inf), fp32 scalars on
        the device, or None. Returns why the step was skipped (verdict='deferred': why the previous one
        was), or None; raises RuntimeError for a NaN/Inf gradient under nonfinite='error'. A skipped step
        changed nothing, its counters included."""
        if self._threads is None and self._native.threads not in (0, torch.get_num_threads()):
            self._native.set_threads(torch.get_num_threads())  # torch's count changed: follow it (0: no CPU threads)
        scale, found = (0, 0) if scaler is None else (0 if scaler[0] is None else scaler[0].data_ptr(),
                                                      scaler[1].data_ptr())
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the optimizer's step cannot be captured in a CUDA graph yet: it is enqueued by the "
                               "native engine, which reads its verdict and uploads its values from the host; call "
                               "step() outside the capture")
        # One native call: the tensors' addresses, versions and gradients read, masters refreshed, the step.
        result = self._native.step(scale, found, self.stream())
        return result.reason if result.skipped else None

    @property
    def pending(self):
        return self._native.pending

    def settle(self):
        """verdict='deferred': the pending step's verdict now, so that the counters are final. Returns why
        that step was skipped, or None; raises as step() would under nonfinite='error'. That step changed
        nothing, its counters included (the native engine rolls them back)."""
        if not self.pending:
            return None
        result = self._native.settle()
        return result.reason if result.skipped else None

    def frozen_with_grad(self):
        """Indices into `frozen` of the parameters that have a gradient now (one native call)."""
        return self._native.frozen_with_grad()

    # ----------------------------------------------------------------------------------------- masters

    def mark_current(self):
        """The caller just wrote masters (and parameters): the tensors count as they are now, so the next
        step reads no master again (a loaded master keeps its low bits)."""
        self._native.mark_current()

    def refresh_masters(self):
        """Outside writes to the model's parameters (load_state_dict, an in-place op under no_grad, p.data = t):
        a bf16/fp16 parameter whose version counter moved or whose storage is new gets its master from it,
        unless it still holds the rounded master (a model reloaded after the optimizer: the master keeps its
        low bits). An fp32 parameter is its own master. Writes through .data bypass the counter and are not
        seen (Engine::refresh_master's rule)."""
        self._native.refresh_masters(self.stream())

    # ------------------------------------------------------------------------------------- state files

    def to_flat(self):
        """A host FlatState (parameters as fp32 masters, state, counters): what state files hold."""
        self.settle()
        self.refresh_masters()
        flat = _C.FlatState(self.layout)
        params = torch.from_numpy(flat.params)
        for e, le in zip(self.entries, self.layout.entries):
            src = e.master if e.master is not None else e.values()
            params[le.offset:le.offset + le.numel].copy_(in_memory_order(e, src).reshape(-1))
        for k, t in self.buffers.items():
            if k != "masters":
                torch.from_numpy(getattr(flat, k)).copy_(t)
        flat.group_steps = list(self.steps)
        flat.entry_steps = list(self.entry_steps)
        return flat

    def from_flat(self, flat):
        """State, masters, counters and the model's parameters from a host FlatState."""
        params = torch.from_numpy(flat.params)
        for k, t in self.buffers.items():
            if k != "masters":
                t.copy_(torch.from_numpy(getattr(flat, k)))
        for e, le in zip(self.entries, self.layout.entries):
            values = caller_view(e, params[le.offset:le.offset + le.numel])
            if e.master is not None:
                e.master.copy_(values)
            e.write(values)  # rounds to the parameter's dtype
        self.mark_current()
        self.set_steps(list(flat.group_steps), list(flat.entry_steps))

    def file_layout(self, header):
        """This layout, or, when a state file names the parameters with other wrapper prefixes (saved under
        DDP or torch.compile and loaded without, or back), the same layout under the file's names: the
        values sit at the same places, so the scratch state loads and moves over unchanged. ValueError for an
        expert bank the file holds whole, or for matrices it holds by their stored rows that are transposed here."""
        in_file = {t["name"] for t in header["tensors"]}
        stripped = set(map(strip_wrappers, in_file))
        whole = [e for e in self.entries if is_piece(e) and strip_wrappers(e.name) in stripped]
        if whole:  # never read a whole tensor's state as its pieces'
            e = whole[0]
            if e.block.k is None:  # a matrix split here, whole in the file
                raise ValueError(f"'{e.name}' is stepped as {e.block.parts} blocks of rows here (split_rows=), but the "
                                 "file has it whole: leave it whole to load the file")
            raise ValueError(f"'{e.name}' is an expert bank {list(e.block.param_shape)} that NorMuon steps as its "
                             f"{e.block.param_shape[0]} experts here, but the file has it saved whole (on AdamW, "
                             "where earlier versions routed banks). Load it into an optimizer that routes as they did: "
                             "overrides={'*experts.*': 'adamw'}, or, when the experts have biases of 2 dimensions "
                             "(earlier versions gave those to NorMuon), {'*experts.*bias*': 'normuon', '*experts.*': "
                             "'adamw'}. Or start without the file")
        ours = [label(e) for e in self.entries]
        if header["layout_fingerprint"] != self.layout.fingerprint and any(e.transposed for e in self.entries):
            as_stored = [copy.copy(e) for e in self.entries]
            for e in as_stored:
                e.transposed = False
            print_of = _C.Layout.build(_C.Manifest(param_specs(as_stored, self.group_names, ours)), self.options)
            if print_of.fingerprint == header["layout_fingerprint"]:
                names = list(dict.fromkeys(e.name for e in self.entries if e.transposed))
                more = f" and {len(names) - 3} more" if len(names) > 3 else ""
                shown = ", ".join(f"'{n}'" for n in names[:3]) + more
                raise ValueError(f"the file holds every matrix by its stored rows (earlier versions, or transposed="
                                 f"{{'*': False}}), but here {shown} run their statistics along the stored columns "
                                 "(stored [in, out]): build the optimizer with transposed={'*': False} to load it")
        if header["layout_fingerprint"] == self.layout.fingerprint or set(ours) <= in_file:
            return self.layout  # load_state says what is wrong, if anything
        by_stripped = {}
        for name in in_file:
            by_stripped.setdefault(strip_wrappers(name), []).append(name)
        renamed = [by_stripped.get(strip_wrappers(n), [None]) for n in ours]
        if any(len(r) != 1 or r[0] is None for r in renamed):
            return self.layout
        layout = _C.Layout.build(_C.Manifest(self.specs([r[0] for r in renamed])), self.options)
        same_places = all((a.offset, a.stat_offset, a.adam_offset) == (b.offset, b.stat_offset, b.adam_offset)
                          for a, b in zip(layout.entries, self.layout.entries))
        return layout if same_places and layout.fingerprint == header["layout_fingerprint"] else self.layout

    def save(self, path, backend_name=None):
        _C.save_state(path, self.to_flat(), self._native.options,
                      backend_name or self.backend)

    # -------------------------------------------------------------------------------------- inspection

    @property
    def backend(self):
        """'fast-cpu', 'fast-cuda' or 'reference-cpu'."""
        return self._native.backend

    @property
    def verdict(self):
        """When a CUDA step's verdict reaches the host: 'sync' | 'deferred'."""
        return self._native.verdict

    @property
    def native(self):
        """normuon._C.Engine."""
        return self._native

    def memory_report(self):
        """Bytes held beyond the model's tensors: state_bytes, master_bytes (fp32 masters of bf16/fp16
        parameters), workspace_bytes (the backend's Newton-Schulz buffers and scratch, and the contiguous copies
        that parameters neither contiguous nor dense are stepped through)."""
        report = dict(self._native.memory_report())
        report["workspace_bytes"] += self._native.staged_bytes
        return report


def resolve_modes(backend, nonfinite, verdict):
    """The backend choice by the core's rule (backend_choice.h: an explicit choice wins over NORMUON_BACKEND,
    then auto), with nonfinite checked by the core too; ValueError names a bad value."""
    core = require("normuon")
    try:
        core.Options().set("nonfinite", nonfinite)
    except (TypeError, ValueError) as error:
        raise ValueError(f"nonfinite={nonfinite!r}: {error}") from None
    if verdict not in ("sync", "deferred"):  # the engine binding's two words (Verdict)
        raise ValueError(f"verdict={verdict!r}: choose sync | deferred")
    return core.resolve_backend_choice(backend or "")


def param_specs(entries, group_names, names=None):
    """The C++ manifest's rows (ParamSpec) of planned entries, under other parameter names if given."""
    default_group = {"normuon": "normuon", "adamw": "adamw"}
    names = names or [label(e) for e in entries]
    return [_C.ParamSpec(n, list(laid_shape(e)), DTYPES[e.dtype], e.role,
                         "" if group_names[e.group] == default_group[e.algorithm] else group_names[e.group], e.override,
                         e.transposed != swapped(e))
            for n, e in zip(names, entries)]


def laid_out(e):
    """The engine's entries for one planned parameter: a copy of it, or, for an expert bank [E, m, n] stepped by
    NorMuon or a matrix split into blocks of rows (split_rows=), one per piece, where it lies ("name[k]",
    "name.partJ" in the layout). A dense tensor that is not contiguous is stepped where it lies, in memory order
    (order): AdamW's elementwise passes at any rank, and a NorMuon matrix that is a transposed view as the
    transposed matrix it is in memory (its statistics along the stored columns). Any other tensor that is not
    contiguous is staged: stepped through a contiguous copy (bind)."""
    contiguous = e.source.is_contiguous()
    if not in_pieces(e):
        x = copy.copy(e)
        order = None if contiguous or e.block is not None else memory_order(e.tensor)
        if order is not None and (e.algorithm == "adamw" or order == (1, 0)):
            x.order = order
        else:
            x.staged = not contiguous
        return [x]
    out = []
    for piece in pieces(e.tensor, e.parts):
        x = copy.copy(e)
        x.block, x.shape, x.staged = piece, piece.shape, not contiguous
        out.append(x)
    return out


def memory_order(t):
    """t's dimensions from the outermost in memory to the innermost when t is dense (its elements fill the span
    they lie in, none twice: channels_last, a transposed view); None when it is not."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    expected = 1
    for d in reversed(order):
        if t.shape[d] != 1 and t.stride(d) != expected:
            return None
        expected *= t.shape[d]
    return tuple(order)


def laid_shape(e):
    """An engine entry's shape as the layout has it: its dimensions in memory order."""
    return e.shape if e.order is None else tuple(e.shape[d] for d in e.order)


def swapped(e):
    """A NorMuon matrix stepped as the transposed matrix it is in memory: the layout's rows are its columns."""
    return e.order is not None and e.algorithm == "normuon"


def caller_view(e, flat):
    """A 1-D slice of the engine's buffers, in the entry's memory order, viewed in the caller's shape (and strides)."""
    v = flat.view(laid_shape(e))
    return v if e.order is None else v.permute(*sorted(range(len(e.order)), key=e.order.__getitem__))


def in_memory_order(e, t):
    """A tensor of the caller's shape as the layout holds it (memory order): caller_view's inverse."""
    return t if e.order is None else t.permute(*e.order)


def in_pieces(e):
    """A planned parameter the engine lays out as several matrices: a bank, or a matrix split into blocks."""
    return e.block is None and (is_bank(e) or e.parts > 1)


def is_piece(e):
    """An engine entry that is one of its parameter's pieces (laid_out): a bank's expert, a block of a split
    matrix. (The Megatron adapter's blocks of rows are parameters of their own to it: no suffix.)"""
    return e.block is not None and bool(e.block.suffix)


def label(e):
    """An engine entry's name in the layout: the parameter's, with its expert's index for a bank's."""
    return e.name + (e.block.suffix if e.block is not None else "")


def by_parameter(entries):
    """{id(tensor): [entries]} of the engine's entries: one per parameter, or a bank's experts in order."""
    out = {}
    for e in entries:
        out.setdefault(id(e.tensor), []).append(e)
    return out


def param_state(entries, master=True):
    """named_state of one parameter from its engine entries: a bank's and a split matrix's are views over its
    pieces' state, which the layout puts a fixed stride apart (consecutive entries of one shape): parameter-
    shaped momentum (and masters), the second moment [E, len] for a bank, and, split into P blocks, [E, P * rows]
    along rows or [E, P, cols] along columns (E left out for a 2-D parameter). ValueError when the blocks'
    state is not back to back (the layout pads each to 16 floats)."""
    if not is_piece(entries[0]):  # a whole parameter, or the adapter's block
        return named_state(entries[0], master)
    first = entries[0].block
    states = [named_state(e, master) for e in entries]
    out = {k: _stacked([s[k] for s in states]) for k in states[0]}
    if first.parts > 1:
        lead = tuple(first.param_shape[:-2])  # (E,) for a bank
        rows = first.param_shape[-2]
        try:
            for k, v in out.items():
                if v.dim() == 3:
                    out[k] = v.view(first.param_shape)
                elif entries[0].stats_per_row:
                    out[k] = v.view(*lead, rows)
                else:
                    out[k] = v.view(*lead, first.parts, v.shape[-1])
        except RuntimeError:
            raise ValueError(f"parameter '{entries[0].name}' {list(first.param_shape)} cannot be split into "
                             f"{first.parts} blocks of rows: the layout pads each block's state to a multiple of 16 "
                             f"floats, so its blocks of {first.shape[0]}x{first.shape[1]} (and their second moments) "
                             "must hold such a multiple") from None
    return out


def _stacked(views):
    """Views of one storage, equal in shape and a fixed number of elements apart, as one view [len, *shape]."""
    first = views[0]
    step = views[1].storage_offset() - first.storage_offset() if len(views) > 1 else first.numel()
    if any(v.storage_offset() != first.storage_offset() + k * step or v.stride() != first.stride()
           for k, v in enumerate(views)):
        raise RuntimeError("a parameter's pieces' state is not a fixed stride apart in the layout")
    return first.as_strided((len(views), *first.shape), (step, *first.stride()), first.storage_offset())


def named_state(e, master=True):
    """{key: view} of an engine entry's state as torch's optimizers name it (momentum_buffer and
    moment2_buffer, or exp_avg and exp_avg_sq), with master_param: a bf16 or fp16 parameter's fp32 master."""
    names = ("momentum_buffer", "moment2_buffer") if e.algorithm == "normuon" else ("exp_avg", "exp_avg_sq")
    out = dict(zip(names, e.state))
    if master and e.low_precision:
        out["master_param"] = e.master
    return out


def one_device(entries):
    """The device every planned parameter is on (a CUDA one with its index); ValueError if they differ."""
    devices = sorted({str(e.tensor.device) for e in entries})
    if len(devices) > 1:
        raise ValueError(f"every parameter must be on one device; got {', '.join(devices)}")
    device = entries[0].tensor.device if entries else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _key(e):
    """What tells the same parameter in two layouts: its tensor, and which matrix inside it (a block of rows,
    an expert)."""
    return id(e.source), None if e.block is None else e.block.geometry


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
