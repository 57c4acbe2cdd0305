"""DistributedNorMuonAdamW: NorMuonAdamW sharded by ownership over torch.distributed (docs/distributed.md).

Newton-Schulz needs whole matrices, so instead of splitting tensors every NorMuon matrix gets one owner rank
(balanced by Newton-Schulz FLOPs, deterministic). Each rank steps only what it owns with an ordinary
NorMuonAdamW built over those parameters (the same per-matrix math as a single process), then one packed
all_gather per step hands every rank the new values of everything else. Gradients must already be
identical on every rank (all-reduced, as in data-parallel training).
"""
import time
import warnings

import torch
import torch.distributed as dist

from .native import _C
from .optim import NorMuonAdamW, NotCopyable
from .plan import ADAMW_KEYS, NORMUON_FIELDS, resolve_inputs
from .routing import ROUTING_COLUMNS, routing_text
from .sharded import _comm_device, _object_group, assign_owners, newton_schulz_flops  # noqa: F401 (shared)

# Group keys that are bookkeeping, not hyper-parameters: never copied into the per-rank optimizer.
_GROUP_BOOKKEEPING = ("params", "names", "name", "algorithm", "step")


class _Param:
    """One parameter in manifest order: the user's tensor and who steps it (owner None: every rank)."""

    __slots__ = ("index", "name", "tensor", "shape", "dtype", "algorithm", "group", "owner", "cost")


class DistributedNorMuonAdamW(NotCopyable, torch.optim.Optimizer):
    """NorMuonAdamW over data-parallel ranks: every NorMuon matrix is orthogonalised by one owner rank, the
    new values are exchanged in one packed all_gather per step, and every rank ends with the same
    parameters, bit for bit equal to a single-process NorMuonAdamW run (docs/distributed.md).

    params, *args, **kwargs: exactly those of NorMuonAdamW (routing, groups, hyper-parameters, backend,
        threads, nonfinite). threads is per rank: with several ranks on one machine give each its share.
    process_group: the torch.distributed group (default: the world); it must be initialised.
    shard_adamw: also give each AdamW parameter one owner (balanced by size) and exchange it in the same
        buffer; off (default), every rank runs the cheap AdamW part itself and nothing of it is sent.

    Preconditions: every rank builds it over the same model (same names, shapes, dtypes, values) and
    calls step() with the same gradients (already all-reduced). step, state_dict, export_state,
    import_state and load_state_dict are collective: every rank calls them, in the same order. NCCL: call
    torch.cuda.set_device(local_rank) first and keep parameters and gradients on that GPU; under an
    NCCL-only group the constructor is collective too (it makes a Gloo group for the pickled state).
    """

    def __init__(self, params, *args, process_group=None, shard_adamw=False, **kwargs):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DistributedNorMuonAdamW needs torch.distributed: call "
                               "torch.distributed.init_process_group() first (gloo on CPUs, nccl on GPUs)")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.shard_adamw = bool(shard_adamw)
        self._backend_choice = kwargs.pop("backend", None)
        self._threads = kwargs.pop("threads", 0)
        self.nonfinite = kwargs.pop("nonfinite", "error")
        # A model, model= and normuon_params= / adamw_params= become named parameters and roles here, so the
        # stand-ins below (and the rebuilds for saving and loading) route exactly as the real tensors do.
        params, kwargs["roles"] = resolve_inputs(params, kwargs.pop("normuon_params", None),
                                                 kwargs.pop("adamw_params", None), kwargs.pop("model", None),
                                                 kwargs.pop("roles", None))
        # Kept to rebuild the single-process optimizer (same manifest order, so the same layout and state
        # files) for saving and loading; generators are turned into lists so they can be walked again.
        self._ctor_params = _listed(params)
        self._ctor_args, self._ctor_kwargs = args, kwargs

        # The single-process optimizer routes, groups and checks everything exactly as one process would;
        # only its plan is kept (its flat buffers are freed again). CUDA tensors get empty CPU stand-ins:
        # the plan depends on names, shapes and dtypes only, and must not take a full state on the GPU.
        real = {}

        def stand_in(t):
            if t.device.type != "cuda" or t.layout != torch.strided:
                return t  # CPU tensors as they are; anything odd reaches NorMuonAdamW's own checks
            s = torch.empty(t.shape, dtype=t.dtype)
            real[id(s)] = t
            return s

        plan = self._single_process(stand_in)
        self._routing = plan.routing_table()
        groups = [dict(g, params=[real.get(id(t), t) for t in g["params"]]) for g in plan.param_groups]
        self._params = []
        for e in plan.engine.entries:  # manifest order
            p = _Param()
            p.index, p.name, p.algorithm, p.group = e.index, e.name, e.algorithm, e.group
            p.tensor = real.get(id(e.tensor), e.tensor)
            p.shape, p.dtype = e.shape, e.dtype
            if p.algorithm == "normuon":
                g = groups[p.group]
                p.cost = newton_schulz_flops(e.shape[0], e.shape[1], g["ns_steps"], g["ns_algorithm"])
            else:
                p.cost = p.tensor.numel()
            self._params.append(p)
        del plan
        devices = sorted({str(p.tensor.device) for p in self._params})
        if len(devices) > 1:  # what the plan said before the stand-ins hid it
            raise ValueError(f"NorMuonAdamW needs every parameter on one device; got {', '.join(devices)}")
        self._assign()
        super().__init__(groups, {})
        self._built = True
        self._steps = [0] * len(self.param_groups)
        self._group_members = [[p for p in self._params if p.group == gi] for gi in range(len(self.param_groups))]

        # This rank's optimizer: the same groups (names, order, hyper-parameters), only what it steps.
        mine = [p for p in self._params if p.owner in (None, self.rank)]
        if not mine:
            # NorMuonAdamW needs a parameter: a rank that owns none steps the cheapest one as well (AdamW
            # first). Only its owner's values and state count: the exchange overwrites this rank's copy.
            mine = [min(self._params, key=lambda p: (p.algorithm == "normuon", p.tensor.numel(), p.index))]
        local_groups = []
        for g, group_members in zip(self.param_groups, self._group_members):
            members = [p for p in group_members if p in mine]
            keys = NORMUON_FIELDS if g["algorithm"] == "normuon" else ADAMW_KEYS
            local_groups.append(dict({k: g[k] for k in keys}, params=[p.tensor for p in members],
                                     names=[p.name for p in members], name=g["name"], algorithm=g["algorithm"]))
        self._local = NorMuonAdamW(local_groups, backend=self._backend_choice, threads=self._threads,
                                   nonfinite=self.nonfinite, _state_for_frozen=True)
        self._local_entry = {e.name: e for e in self._local.engine.entries}  # fp32 masters of what it steps
        for p in mine:
            if p.owner in (None, self.rank):
                self.state[p.tensor] = self._local.state[p.tensor]

        # The exchange: rank r's owned parameters (manifest order) packed into one fp32 buffer, padded to
        # the largest rank's size because gloo's all_gather takes equal sizes. Packing happens on the
        # parameters' device; NCCL needs the collective's buffers on this rank's GPU.
        self._owned_by = [[p for p in self._params if p.owner == r] for r in range(self.world_size)]
        self._exchange_numel = max((sum(p.tensor.numel() for p in ps) for ps in self._owned_by), default=0)
        self._device = self._params[0].tensor.device  # NorMuonAdamW keeps all parameters on one device
        dist_backend = str(dist.get_backend(process_group)).lower()
        self._comm_device = _comm_device(dist_backend, self._device)
        self._pack = torch.zeros(self._exchange_numel, device=self._device)
        self._send = (self._pack if self._comm_device == self._device
                      else torch.zeros(self._exchange_numel, device=self._comm_device))
        self._recv = torch.zeros(self.world_size, self._exchange_numel, device=self._comm_device)
        # Under NCCL, all_gather_into_tensor fills the flat buffer directly, with no list of views (torch >=
        # 1.13); Gloo keeps the list form, which older Gloo builds need.
        self._gather_into = (self._comm_device.type == "cuda" and "nccl" in dist_backend
                             and hasattr(dist, "all_gather_into_tensor"))
        self._object_group = _object_group(process_group, dist_backend)
        # The NaN/Inf verdict: the parameters this rank answers for, their indices on the device.
        self._answers = [p for p in self._params if p.owner == self.rank or (p.owner is None and self.rank == 0)]
        self._answer_index = torch.tensor([p.index for p in self._answers], dtype=torch.int64, device=self._device)
        self._none_bad = torch.tensor(len(self._params), dtype=torch.int64, device=self._device)
        self._finite = torch.ones((), dtype=torch.bool, device=self._device)
        self.comm_stats = dict(steps=0, collectives=0, bytes_sent=0, bytes_received=0)
        self.last_step_comm = dict(collectives=0, bytes_sent=0, bytes_received=0)
        self.last_step_seconds = dict(local=0.0, exchange=0.0)
        self.last_skip_reason = None

    # ------------------------------------------------------------------------------------------ ownership

    def _assign(self):
        """NorMuon matrices by Newton-Schulz FLOPs; then (shard_adamw) AdamW parameters by size, starting
        from the matrices' sizes per rank so the packed buffers come out even. Others: every rank."""
        matrices = [p for p in self._params if p.algorithm == "normuon"]
        owners, _ = assign_owners([p.cost for p in matrices], self.world_size)
        sizes = [0] * self.world_size
        for p, r in zip(matrices, owners):
            p.owner = r
            sizes[r] += p.tensor.numel()
        adamw = [p for p in self._params if p.algorithm == "adamw"]
        if self.shard_adamw:
            owners, _ = assign_owners([p.cost for p in adamw], self.world_size, loads=sizes)
        else:
            owners = [None] * len(adamw)
        for p, r in zip(adamw, owners):
            p.owner = r

    def ownership_table(self):
        """One row per parameter (manifest order): name, algorithm, owner (a rank, or 'all' when every rank
        steps it) and cost (Newton-Schulz FLOPs for a matrix, elements for AdamW)."""
        return [dict(index=p.index, name=p.name, algorithm=p.algorithm, shape=tuple(p.tensor.shape),
                     owner="all" if p.owner is None else p.owner, cost=p.cost) for p in self._params]

    def routing_table(self):
        """NorMuonAdamW's routing table (the same on every rank) with each parameter's owner: the rank that
        steps it and sends its values, or 'all' when every rank steps it."""
        owners = {p.name: "all" if p.owner is None else p.owner for p in self._params}
        return [dict(r, owner=owners[r["name"]]) for r in self._routing]

    def routing_text(self):
        return routing_text("DistributedNorMuonAdamW", self.routing_table(),
                            f"{self.world_size} ranks, this one {self.rank}; backend {self.backend}",
                            ROUTING_COLUMNS[:-1] + ("owner", "why"))

    def print_routing(self, file=None):
        print(self.routing_text(), file=file)

    def owned_names(self, rank=None):
        """Names of the parameters that `rank` (default: this one) owns and sends to the others."""
        rank = self.rank if rank is None else rank
        return [p.name for p in self._params if p.owner == rank]

    @property
    def backend(self):
        return self._local.backend

    def add_param_group(self, param_group):
        if getattr(self, "_built", False):
            raise NotImplementedError("DistributedNorMuonAdamW fixes its layout and ownership when it is built: "
                                      "create a new optimizer with all parameter groups")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------------------------------- the step

    @torch.no_grad()
    def step(self, closure=None):
        """One step on every rank (collective). Same semantics as NorMuonAdamW.step: a NaN/Inf gradient
        raises RuntimeError on every rank before anything changes, or skips the step everywhere."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_tensors()
        local = self._local
        local.nonfinite = self.nonfinite
        for g, lg in zip(self.param_groups, local.param_groups):
            lg.update({k: v for k, v in g.items() if k not in _GROUP_BOOKKEEPING})
        local._sync_hyper()  # a bad value raises here, on every rank alike, before any collective
        for g, lg in zip(self.param_groups, local.param_groups):  # NorMuon's betas and beta1/beta2 as resolved
            g.update({k: lg[k] for k in ("beta1", "beta2", "betas") if k in lg})
        local.engine.set_steps(self._steps, local.engine.entry_steps)  # its parameters keep their own counts
        start = time.perf_counter()
        self.last_step_comm = dict(collectives=0, bytes_sent=0, bytes_received=0)

        # The NaN/Inf verdict must be the same everywhere before anyone changes anything: each rank looks
        # at the gradients it answers for, the first bad one in manifest order wins. One rank alone leaves
        # it to its local optimizer, which gives the same verdict and message.
        bad = len(self._params)
        if self.world_size > 1:
            flag = self._first_nonfinite().reshape(1).to(self._comm_device, copy=True)  # all_reduce writes in place
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.process_group)
            self._count(8, 8)
            bad = int(flag.item())
        if bad < len(self._params):
            self.last_skip_reason = self._nonfinite(self._params[bad])  # raises under nonfinite='error'
            return loss

        local.step()
        if local.last_skip_reason is not None:  # one rank, skip_step: nothing changed
            self.last_skip_reason = local.last_skip_reason
            return loss
        self._wait_for_device()
        exchange_start = time.perf_counter()
        self._exchange()
        self._wait_for_device()
        done = time.perf_counter()
        # The group counters of one process: a group advances when any of its parameters had a gradient.
        for gi, members in enumerate(self._group_members):
            if any(p.tensor.grad is not None for p in members):
                self._steps[gi] += 1
        local.engine.set_steps(self._steps, local.engine.entry_steps)  # its parameters keep their own counts
        for g, t in zip(self.param_groups, self._steps):
            g["step"] = t
        self.last_skip_reason = None
        self.last_step_seconds = dict(local=exchange_start - start, exchange=done - exchange_start)
        self.comm_stats["steps"] += 1
        return loss

    def _check_tensors(self):
        """What NorMuonAdamW refuses for its own parameters, checked for all of them on every rank, so no
        rank raises alone and leaves the others waiting in a collective."""
        for p in self._params:
            t = p.tensor
            if t.shape != p.shape or t.dtype != p.dtype or t.device != self._device:
                raise RuntimeError(f"parameter '{p.name}' is now {t.dtype} {list(t.shape)} on {t.device}; it was "
                                   f"{p.dtype} {list(p.shape)} on {self._device} when the optimizer was built")
            if t.grad is not None and t.grad.is_sparse:
                raise RuntimeError(f"parameter '{p.name}' has a sparse gradient, which NorMuonAdamW does not support")

    def _first_nonfinite(self):
        """The manifest index of the first gradient with a NaN/Inf among those this rank answers for (what
        it owns, and on rank 0 what every rank steps; the local optimizer scans its gradients again, so each
        extra rank scanning shared ones would be a waste), else len(params): a 0-d int64 tensor, reduced on
        the device so that CUDA waits once, at the collective's .item(), not once per gradient."""
        if not self._answers:
            return self._none_bad
        finite = torch.stack([self._finite if p.tensor.grad is None
                              else torch.isfinite(p.tensor.grad).all().to(self._device) for p in self._answers])
        return torch.where(finite, self._none_bad, self._answer_index).min()

    def _wait_for_device(self):
        """CUDA work is queued: wait for it, so that last_step_seconds times the work, not the enqueueing."""
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()

    def _nonfinite(self, p):
        """The single-process outcome (core/src/step_prologue.cpp); every rank has the same gradient."""
        grad = p.tensor.grad.detach().to(torch.float32).reshape(-1)
        k = int((~torch.isfinite(grad)).nonzero()[0])
        return _C.nonfinite_gradient(p.name, float(grad[k]), k, self._steps[p.group] + 1, self.nonfinite)

    def _exchange(self):
        """Each rank packs the fp32 values of what it owns, one all_gather, everyone unpacks the rest (only
        parameters that had a gradient changed, as in one process)."""
        if self.world_size == 1 or self._exchange_numel == 0:
            return
        at = 0
        for p in self._owned_by[self.rank]:
            n = p.tensor.numel()
            self._pack[at:at + n].copy_(self._local_entry[p.name].param.reshape(-1))
            at += n
        if self._send is not self._pack:
            self._send.copy_(self._pack)
        if self._gather_into:
            dist.all_gather_into_tensor(self._recv.view(-1), self._send, group=self.process_group)
        else:
            dist.all_gather(list(self._recv.unbind(0)), self._send, group=self.process_group)
        numel_bytes = self._exchange_numel * 4
        self._count(numel_bytes, (self.world_size - 1) * numel_bytes)
        recv = self._recv.to(self._device)
        for rank, owned in enumerate(self._owned_by):
            if rank == self.rank:
                continue
            at = 0
            for p in owned:
                n = p.tensor.numel()
                if p.tensor.grad is not None:
                    p.tensor.detach().copy_(recv[rank, at:at + n].view(p.tensor.shape))  # rounds to its dtype
                at += n

    def _count(self, sent, received):
        for stats in (self.comm_stats, self.last_step_comm):
            stats["collectives"] += 1
            stats["bytes_sent"] += sent
            stats["bytes_received"] += received

    # ------------------------------------------------------------------------------------------ state

    def _single_process(self, replace, backend="reference", cls=NorMuonAdamW):
        """The NorMuonAdamW one process would build (by default on the reference backend: no workspace),
        over stand-ins for the model's tensors: replace(tensor) -> tensor."""
        params = _swapped(self._ctor_params, replace)
        with warnings.catch_warnings():
            if getattr(self, "_built", False):  # its warnings (unnamed matrices) were given at construction
                warnings.simplefilter("ignore")
            return cls(params, *self._ctor_args, backend=backend, threads=self._threads,
                       nonfinite=self.nonfinite, _state_for_frozen=True, **self._ctor_kwargs)

    def _my_state(self):
        """{name: state tensors} of what this rank answers for: what it owns, plus (rank 0) what every rank
        steps. On the CPU: pickled CUDA tensors would be restored on the sender's GPU by every receiver."""
        sd = self._local.state_dict()
        names = [n for g in sd["param_groups"] for n in g["names"]]
        keep = {p.name for p in self._answers}
        return {n: {k: v.detach().cpu() for k, v in sd["state"][i].items()}
                for i, n in enumerate(names) if n in keep}

    def _full_state_dict(self, by_name):
        """The single-process state dict (NorMuonAdamW.state_dict's structure and numbering)."""
        groups, state, index = [], {}, 0
        for g in self.param_groups:
            packed = {k: (list(v) if isinstance(v, list) else v) for k, v in g.items() if k != "params"}
            packed["params"] = list(range(index, index + len(g["params"])))
            for name in g["names"]:
                state[index] = by_name[name]
                index += 1
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def state_dict(self):
        """Collective. The state dict a single-process NorMuonAdamW would return (every rank gets it), so
        torch.save of it on rank 0 loads at any world size, or in one process."""
        parts = [None] * self.world_size
        dist.all_gather_object(parts, self._my_state(), group=self._object_group)
        merged = {}
        for part in parts:  # on the parameters' device, as NorMuonAdamW.state_dict returns it
            merged.update({n: {k: v.to(self._device) for k, v in s.items()} for n, s in part.items()})
        return self._full_state_dict(merged)

    def export_state(self, path):
        """Collective. Rank 0 writes the single-process state file (NorMuonAdamW.export_state: atomic,
        checksummed); any world size, one process or `normuon run --load` reads it back."""
        parts = [None] * self.world_size if self.rank == 0 else None
        leader = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        dist.gather_object(self._my_state(), parts, dst=leader, group=self._object_group)
        error = [None]
        if self.rank == 0:
            try:
                merged = {}
                for part in parts:
                    merged.update(part)
                # A reference optimizer over CPU copies (no second full state on the GPU, no workspace) that
                # names the backend that made the state; the file is the same bytes as the run's own writer.
                writer = self._single_process(lambda t: t.detach().cpu(), cls=_StateWriter)
                writer.ran_on = self.backend
                writer.load_state_dict(self._full_state_dict(merged))
                writer.export_state(path)
            except Exception as exc:  # told to every rank below, so none carries on alone
                error = [f"{type(exc).__name__}: {exc}"]
        dist.broadcast_object_list(error, src=leader, group=self._object_group)
        if error[0] is not None:
            raise RuntimeError(f"export_state({path!s}) failed on rank 0: {error[0]}")

    def load_state_dict(self, state_dict):
        """Collective; every rank passes the same single-process state dict (from state_dict() at any world
        size, or NorMuonAdamW.state_dict()). All checks first, on every rank: on an error nothing changes."""
        self._load(lambda single: single.load_state_dict(state_dict), replace_groups=True, set_params=False)

    def import_state(self, path):
        """Collective; every rank reads the same single-process state file (export_state at any world size,
        NorMuonAdamW.export_state, `normuon run --save`): state, group steps, hyper-parameters and the
        model's parameters. All or nothing, on every rank."""
        self._load(lambda single: single.import_state(path), replace_groups=False, set_params=True)

    def _load(self, load, replace_groups, set_params):
        """Loads into a single-process optimizer over stand-ins of the parameters, agrees with every rank
        that it worked, then takes this rank's part."""
        error = None
        try:
            # CPU copies: the layout does not depend on the device, and copy_ moves the values back.
            stand_ins = {id(p.tensor): p.tensor.detach().to("cpu", copy=True) for p in self._params}
            single = self._single_process(lambda t: stand_ins[id(t)])
            load(single)
            full = single.state_dict()
        except Exception as exc:
            error = exc
        verdicts = [None] * self.world_size
        dist.all_gather_object(verdicts, None if error is None else f"{type(error).__name__}: {error}",
                               group=self._object_group)
        if error is not None:
            raise error
        for rank, verdict in enumerate(verdicts):
            if verdict is not None:
                raise RuntimeError(f"rank {rank} could not load the state ({verdict}); nothing was changed")

        # This rank's part, in the local optimizer's numbering; it was all checked above.
        local_groups, local_state, index = [], {}, 0
        full_index = {n: i for i, n in enumerate(n for g in full["param_groups"] for n in g["names"])}
        for source, lg in zip(single.param_groups, self._local.param_groups):
            local = {k: v for k, v in source.items() if k != "params"}
            local.update(names=list(lg["names"]), params=list(range(index, index + len(lg["names"]))))
            for name in lg["names"]:
                local_state[index] = full["state"][full_index[name]]
                index += 1
            local_groups.append(local)
        self._local.load_state_dict({"state": local_state, "param_groups": local_groups})
        for g, source in zip(self.param_groups, single.param_groups):
            new = {k: v for k, v in source.items() if k != "params"}
            if replace_groups:  # as NorMuonAdamW.load_state_dict: the saved group replaces the live one
                tensors = g["params"]
                g.clear()
                g.update(new, params=tensors)
            else:  # as NorMuonAdamW.import_state: the file's values go into the live group
                g.update({k: v for k, v in new.items() if k != "names"})
        self._steps = [g["step"] for g in single.param_groups]
        if set_params:
            for p in self._params:
                p.tensor.detach().copy_(stand_ins[id(p.tensor)])

class _StateWriter(NorMuonAdamW):
    """The state file writer of export_state: a CPU reference optimizer whose file names the backend that ran
    the steps (the header records it; the values do not depend on it)."""

    ran_on = None

    @property
    def backend(self):
        return self.ran_on


def _listed(params):
    """The constructor's params with every iterable made a list (it is walked again on save and load)."""
    if isinstance(params, torch.Tensor):
        return [params]
    out = []
    for item in params:
        if isinstance(item, dict) and "params" in item and not isinstance(item["params"], torch.Tensor):
            item = dict(item, params=list(item["params"]))
        out.append(item)
    return out


def _swapped(params, replace):
    """The constructor's params with each tensor t replaced by replace(t); anything else is left for
    NorMuonAdamW to judge."""

    def swap(x):
        if isinstance(x, torch.Tensor):
            return replace(x)
        if isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor):
            return (x[0], replace(x[1]))
        return x

    out = []
    for item in params:
        if isinstance(item, dict) and "params" in item:
            ps = item["params"]
            item = dict(item, params=swap(ps) if isinstance(ps, torch.Tensor) else [swap(x) for x in ps])
        else:
            item = swap(item)
        out.append(item)
    return out
