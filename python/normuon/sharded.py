"""NorMuonAdamW over DTensor parameters: FSDP2 (fully_shard: Shard(0) on a 1-D mesh), FSDP x TP (a 2-D mesh,
Shard on either dimension), replicated (data-parallel), or any mix whose local pieces are blocks of the
whole tensor. The step of one process, bit for bit, with every rank holding only its pieces
(docs/distributed.md).

AdamW and every elementwise pass run on the local pieces: the engine binds each DTensor's local tensor and
reads its gradient's local piece. NorMuon needs whole matrices: an expert bank whose ranks hold whole experts
(fully_shard's cut, HSDP's too) is stepped by each rank on its own experts; every other matrix or bank has one
owner rank, balanced by the Newton-Schulz cost the core computes. Per step, one packed all_to_all hands every
owner the blocks of its matrices (parameters and gradients, each block sent once however many ranks hold it);
the owner's engine steps whole matrices, the arithmetic of one process; one packed all_to_all returns every
rank its new block.
A matrix every rank holds whole is stepped by its owner where it lies. A NaN/Inf gradient is found on every
rank alike, before anything changes (a small all_reduce), and the group counters follow the core's rule
over the whole model, so every rank reports the same. State dicts are DTensors laid out as their
parameters, for torch.distributed.checkpoint.
"""
import copy
import itertools
import math

import torch
import torch.distributed as dist

from .engine import by_parameter, label, laid_out, param_specs, param_state
from .native import _C, require

_DTENSOR = []  # torch.distributed.tensor.DTensor, or None where this torch has none: looked up once


def dtensor_type():
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor
        except Exception:  # noqa: BLE001 - torch 1.13 has none (and may fail otherwise than ImportError)
            DTensor = None
        _DTENSOR.append(DTensor)
    return _DTENSOR[0]


def is_sharded(entries):
    """Whether the planned parameters are DTensors (all of them: a mix is refused by Shards). FSDP1's
    flattened parameters are refused: a flat 1-D shard of many tensors would go to AdamW without a word."""
    for e in entries:
        if getattr(e.tensor, "_fsdp_flattened", False) or type(e.tensor).__name__ == "FlatParameter":
            raise ValueError(f"parameter '{e.name}' is a flattened parameter of FSDP1 (FullyShardedDataParallel): a "
                             "1-D shard of several tensors, whose matrices NorMuon cannot see. Shard the model with "
                             "FSDP2 instead (torch.distributed.fsdp.fully_shard), which NorMuonAdamW serves")
    kind = dtensor_type()
    return kind is not None and any(isinstance(e.tensor, kind) for e in entries)


def assign_owners(costs, world_size, loads=None):
    """Greedy longest-processing-time: items sorted by (cost desc, index), each to the least loaded rank
    (ties: the lowest rank). Integer costs keep it exact, so every rank computes the same map.
    Returns (owner per item, final load per rank)."""
    loads = list(loads) if loads is not None else [0] * world_size
    owners = [None] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += costs[i]
    return owners, loads


def newton_schulz_flops(rows, cols, ns_steps, ns_algorithm="standard"):
    """FLOPs (2 per multiply-add) of one Newton-Schulz run on a rows x cols matrix, every product in full:
    the core's count (ns_dense_flops, core/include/normuon/ns_algorithm.h), as an integer, the same on
    every rank."""
    return int(require("NorMuonAdamW").ns_dense_flops(ns_algorithm, rows, cols, ns_steps))


def _shard_dim(placement):
    """The tensor dimension a Shard (or FSDP2's _StridedShard, over TP) placement cuts, or None."""
    return placement.dim if placement.is_shard() or hasattr(placement, "split_factor") else None


def _comm_device(dist_backend, device):
    """Where the collectives' buffers live. NCCL moves CUDA tensors only: the parameters' GPU, which must be
    this rank's current device (NCCL's communicator is bound to it); CPU parameters under a plain "nccl"
    group go through the current device. Gloo (also the CPU half of "cpu:gloo,cuda:nccl") moves CPU ones."""
    if "nccl" not in dist_backend:
        return torch.device("cpu")
    if device.type == "cuda":
        current = torch.cuda.current_device()
        if device.index != current:
            raise RuntimeError(f"the parameters are on {device}, but this rank's current "
                               f"CUDA device is cuda:{current}; NCCL needs each rank's GPU to be its current device: "
                               "call torch.cuda.set_device(local_rank) on every rank before init_process_group "
                               "and before building the model")
        return device
    if "gloo" in dist_backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _object_group(process_group, dist_backend):
    """The group for the pickled state and verdicts (state_dict, export_state, loading). A group with NCCL
    only would stage every rank's pickle on each GPU: a Gloo side group over the world moves them on the
    CPU. new_group is collective over the whole world, so it is made only when this group spans it (every
    rank builds this optimizer then); a smaller NCCL-only group carries the objects itself."""
    if "nccl" not in dist_backend or "gloo" in dist_backend or not dist.is_gloo_available():
        return process_group
    if process_group is not None and dist.get_world_size(process_group) != dist.get_world_size():
        return process_group
    return dist.new_group(backend="gloo")


def _moment2_dims(e):
    """(lead, axis): a NorMuon parameter's leading dimensions (1 for a bank [E, m, n], else 0), which its second
    moment keeps, and the dimension the statistics run along."""
    lead = len(e.shape) - 2
    return lead, lead + (0 if e.stats_per_row else 1)


def _local(t):
    """A DTensor's local piece, or a plain tensor itself (replicated over a process group)."""
    return t._local_tensor if isinstance(t, dtensor_type() or ()) else t


def _slices(block):
    return tuple(slice(lo, hi) for lo, hi in block)


def _numel(block):
    return math.prod(hi - lo for lo, hi in block)


def _senders(blocks):
    """Per rank: whether it sends its block, i.e. is the lowest rank holding that (non-empty) block."""
    first = {}
    for r, b in enumerate(blocks):
        first.setdefault(b, r)
    return [first[b] == r and _numel(b) > 0 for r, b in enumerate(blocks)]


class Shards:
    """The sharded layout of one optimizer: each rank's block of every parameter, which rank owns which
    NorMuon matrix, the entries this rank's engine steps, the exchange, the NaN/Inf verdict and the group
    counters of the whole model.

    planned: the optimizer's planned entries (global shapes, their tensors DTensors); groups: (name,
    algorithm, checked values) per group, as the engine takes them; process_group: instead of DTensors,
    plain tensors that every rank of this group holds whole, with the same gradients (DDP)."""

    def __init__(self, planned, groups, process_group=None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("sharded or process_group= parameters need torch.distributed: call "
                               "torch.distributed.init_process_group() first (gloo on CPUs, nccl on GPUs)")
        kind = dtensor_type()
        meshes = []
        for e in planned:
            where = f"parameter '{e.name}'"
            if e.parts > 1:
                raise ValueError(f"{where} is split into blocks of rows (split_rows=), which sharded training does "
                                 "not step yet: leave it whole (the default), or step it in one process")
            if process_group is not None:
                if kind is not None and isinstance(e.tensor, kind):
                    raise ValueError(f"{where} is a DTensor: process_group= is for plain tensors every rank holds "
                                     "whole (DDP); DTensors bring their own mesh")
                if e.block is not None:
                    raise ValueError(f"{where}: blocks of rows under process_group= are not served")
                continue
            if not isinstance(e.tensor, kind):
                raise ValueError(f"{where} is a plain tensor beside DTensor parameters: shard every parameter (FSDP2's "
                                 "fully_shard on the model) or none")
            if e.tensor.device_mesh not in meshes:
                meshes.append(e.tensor.device_mesh)
            partial = [p for p in e.tensor.placements if _shard_dim(p) is None and not p.is_replicate()]
            if partial:
                raise ValueError(f"{where} has placements {tuple(e.tensor.placements)}: {partial[0]} holds partial "
                                 "values; reduce it to Shard or Replicate before the step")
            if e.block is not None:
                raise ValueError(f"{where}: blocks of rows of a sharded parameter are not served")
        # The collectives go over one 1-D mesh's group, or else (FSDP x TP: a 2-D mesh, and its 1-D dp part
        # for the parameters TP leaves whole) over the world, every rank of which holds a block of each.
        if process_group is not None:
            self.group = process_group
        elif len(meshes) == 1 and meshes[0].ndim == 1:
            self.group = meshes[0].get_group()
        elif max(m.size() for m in meshes) == dist.get_world_size():
            self.group = None  # the world, which the largest mesh spans
        else:
            raise ValueError("a mesh of more than one dimension (or several meshes) over part of the world is not "
                             "served: the collectives go over the world, which the mesh must span")
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        backend = str(dist.get_backend(self.group)).lower()
        self.comm_device = _comm_device(backend, _local(planned[0].tensor).device)  # NCCL: CUDA buffers only
        self.object_group = _object_group(self.group, backend)  # pickles over Gloo where NCCL is the group's
        self.planned = planned
        # This rank's block of each parameter (ranges per dimension), as DTensor lays it out; then everyone's.
        if process_group is not None:  # every rank holds every tensor whole
            mine = [tuple((0, n) for n in e.shape) for e in planned]
        else:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            mine = []
            for e in planned:
                shape, offset = compute_local_shape_and_global_offset(e.shape, e.tensor.device_mesh,
                                                                      e.tensor.placements)
                local = tuple(_local(e.tensor).shape)
                if tuple(shape) != local or not _local(e.tensor).is_contiguous():
                    raise ValueError(f"parameter '{e.name}': its local piece {list(local)} is not the block its "
                                     f"placements {tuple(e.tensor.placements)} give ({list(shape)}): uneven custom "
                                     "sharding is not served")
                mine.append(tuple((o, o + n) for o, n in zip(offset, shape)))
        every = self._agree(planned, mine)
        self.blocks = [[every[r][i] for r in range(self.world)] for i in range(len(planned))]
        # Who sends each distinct block (the lowest rank that holds it): a block is sent once.
        self.sender = [_senders(blocks) for blocks in self.blocks]
        for e, blocks, senders in zip(planned, self.blocks, self.sender):
            if sum(_numel(b) for b, first in zip(blocks, senders) if first) != math.prod(e.shape):
                raise ValueError(f"parameter '{e.name}': the ranks' blocks do not tile it once: its meshes do not "
                                 "cover the ranks of the optimizer's group")
        # A bank whose ranks hold whole experts (_experts_apart): each rank steps its own experts where they lie,
        # no exchange. Any other matrix or bank: one owner, for all its experts.
        self.local = {i for i in range(len(planned)) if self._experts_apart(i)}
        matrices = [e for i, e in enumerate(planned) if e.algorithm == "normuon" and i not in self.local]
        values = [v for _, _, v in groups]
        at = {id(e): i for i, e in enumerate(planned)}  # everything below is keyed by position in `planned`
        costs = [math.prod(e.shape[:-2]) * self._expert_cost(at[id(e)], values) for e in matrices]
        # The ranks start from the experts they step where they lie.
        loads = [sum(_numel(self.blocks[i][r][:1]) * self._expert_cost(i, values) for i in self.local)
                 for r in range(self.world)]
        owners, _ = assign_owners(costs, self.world, loads)
        self.owner = {at[id(e)]: r for e, r in zip(matrices, owners)}
        self.cost = {at[id(e)]: c for e, c in zip(matrices, costs)}
        self.cost.update({i: planned[i].shape[0] * self._expert_cost(i, values) for i in self.local})
        self.entries = []  # what this rank's engine steps, in manifest order
        self.positions = []  # of each of them in `planned`
        self.laid_counts = []  # of each of them: the engine's entries for it (a bank: its experts here)
        self.proxies = {}  # position -> the whole matrix an owner steps
        self.grads = {}    # position -> its gradient buffer (the proxy's .grad when the matrix has a gradient)
        for i, e in enumerate(planned):
            if e.algorithm == "normuon" and self.owner.get(i, self.rank) != self.rank:
                continue
            if i in self.local and _numel(self.blocks[i][self.rank]) == 0:
                continue  # none of the bank's experts here
            mine = copy.copy(e)
            if e.algorithm == "normuon" and i not in self.local and not self._whole_everywhere(i):  # whole here
                mine.tensor = torch.zeros(e.shape, dtype=e.dtype, device=_local(e.tensor).device)
                self.grads[i] = mine.tensor.grad = torch.zeros_like(mine.tensor)
                self.proxies[i] = mine.tensor
            else:
                mine.tensor = _local(e.tensor)
                mine.shape = tuple(mine.tensor.shape)
                mine.grad_of = e.tensor if mine.tensor is not e.tensor else None
            self.entries.append(mine)
            self.positions.append(i)
            self.laid_counts.append(len(laid_out(mine)))
        # The whole model's layout: the counters of one process (the core's rule, _C.advance_steps), over the
        # layout's entries (a bank's experts, each at its bank's count); spans: each parameter's entries.
        options = _C.Options([(name, algorithm) for name, algorithm, _ in groups])
        for i, v in enumerate(values):
            options.set_group(i, v)
        laid = [laid_out(e) for e in planned]
        ends = list(itertools.accumulate(map(len, laid)))
        self.spans = [range(end - len(xs), end) for xs, end in zip(laid, ends)]
        flat = [x for xs in laid for x in xs]
        names = [label(x) for x in flat]
        self.layout = _C.Layout.build(_C.Manifest(param_specs(flat, [name for name, _, _ in groups], names)), options)
        for e, span in zip(planned, self.spans):  # the routing table's statistics axis (a bank's: its experts')
            le = self.layout.entries[span[0]]
            e.stats_per_row, e.stat_len = le.stats_per_row, le.stat_len
        self.steps = [0] * len(values)
        self.entry_steps = [0] * len(planned)
        # Bytes this rank sent and received through torch.distributed: in all, and in the last step (not
        # what state dicts and files move after it).
        self.comm_stats = dict(steps=0, collectives=0, bytes_sent=0, bytes_received=0)
        self.last_step_comm = dict(collectives=0, bytes_sent=0, bytes_received=0)
        self._tallies = (self.comm_stats,)  # where _count adds: the step's too while it runs
        self._plans = {}  # (inward, gradients present) -> the exchange's moves

    def ownership(self):
        """One row per parameter (manifest order): index, name, algorithm, shape, owner (the rank that runs a
        matrix's Newton-Schulz and sends its new values; 'all' for what every rank steps on its own piece: AdamW's,
        and the experts of a bank fully_shard cut) and cost (Newton-Schulz FLOPs of a matrix or a bank's experts,
        elements of the rest)."""
        return [dict(index=e.index, name=e.name, algorithm=e.algorithm, shape=tuple(e.shape),
                     owner=self.owner.get(i, "all"), cost=self.cost.get(i, math.prod(e.shape)))
                for i, e in enumerate(self.planned)]

    def agree(self, error):
        """Every rank's outcome (None, or what went wrong) (collective): (rank, error) of the first rank that
        failed, or None. Before a collective that some ranks would not reach."""
        every = [None] * self.world
        dist.all_gather_object(every, error, group=self.object_group)
        return next(((r, e) for r, e in enumerate(every) if e is not None), None)

    def _expert_cost(self, i, values):
        """One matrix of parameter i (an expert of a bank): its Newton-Schulz FLOPs."""
        e = self.planned[i]
        v = values[e.group]
        return newton_schulz_flops(e.shape[-2], e.shape[-1], v["ns_steps"], v.get("ns_algorithm", "standard"))

    def _experts_apart(self, i):
        """Parameter i is a NorMuon bank whose ranks hold whole experts, cut along them: fully_shard's Shard(0),
        also under HSDP's replicas (which step their experts alike). Not a bank every rank holds whole
        (process_group=): its owner spreads the work instead."""
        e, blocks = self.planned[i], self.blocks[i]
        held = [b for b in blocks if _numel(b)]
        return e.algorithm == "normuon" and len(e.shape) == 3 and (self.world == 1 or not self._whole_everywhere(i)) \
            and all(b[1:] == ((0, e.shape[1]), (0, e.shape[2])) for b in held)

    def _whole_everywhere(self, i):
        full = tuple((0, n) for n in self.planned[i].shape)
        return all(b == full for b in self.blocks[i])

    def _agree(self, planned, blocks):
        """Every rank's blocks, after checking that every rank of the mesh holds the same parameter list
        (names, shapes, dtypes, routing): else a ValueError on every rank alike, naming the first difference,
        instead of a collective that hangs."""
        mine = [(e.name, tuple(e.shape), str(e.dtype), e.algorithm) for e in planned]
        every = [None] * self.world
        dist.all_gather_object(every, (mine, blocks), group=self.object_group)
        for r, (theirs, _) in enumerate(every):
            if theirs != mine:
                diff = next((f"'{a[0]}' {a[1:]} here, '{b[0]}' {b[1:]} on rank {r}" for a, b in zip(mine, theirs)
                             if a != b), f"{len(mine)} parameters here, {len(theirs)} on rank {r}")
                raise ValueError(f"the ranks of the mesh disagree on the parameters ({diff}): build the optimizer "
                                 "over the same model on every rank")
        return [b for _, b in every]

    # ---------------------------------------------------------------------------------------- the step

    def step(self, engine, nonfinite):
        """One step of every rank (collective): the verdict, the exchange in, the engine's step, the
        exchange out, the counters. Returns the reason a skip_step policy skipped it, or None."""
        has_grad = [e.tensor.grad is not None for e in self.planned]
        for e, present in zip(self.planned, has_grad):  # a gradient laid out otherwise than its parameter
            g = e.tensor.grad
            if present and isinstance(g, dtensor_type() or ()) and g.placements != e.tensor.placements:
                e.tensor.grad = g.redistribute(g.device_mesh, e.tensor.placements)  # (alike on every rank)
        self.last_step_comm = dict(collectives=0, bytes_sent=0, bytes_received=0)
        self.comm_stats["steps"] += 1
        self._tallies = (self.comm_stats, self.last_step_comm)
        try:
            bad = self._first_nonfinite(has_grad)
            if bad is not None:
                index, element, value = bad
                e, span = self.planned[index], self.spans[index]
                # One process names a bank's expert and the element inside it.
                k, element = divmod(element, math.prod(e.shape[-2:])) if len(span) > 1 else (0, element)
                return _C.nonfinite_gradient(self.layout.entries[span[k]].name, value, element,
                                             self.steps[e.group] + 1, nonfinite)
            self._exchange(has_grad, inward=True)
            skipped = engine.step()
            if skipped is not None:  # (every gradient was checked above, on every rank)
                raise RuntimeError(f"rank {self.rank}: the engine skipped a step the ranks agreed on: {skipped}")
            self._exchange(has_grad, inward=False)
        finally:
            self._tallies = (self.comm_stats,)
        counts = [self.entry_steps[i] for i, span in enumerate(self.spans) for _ in span]
        self.steps, counts = _C.advance_steps(self.layout, [has_grad[i] for i, span in enumerate(self.spans)
                                                            for _ in span], self.steps, counts)
        self.entry_steps = [counts[span[0]] for span in self.spans]
        self._set_engine_steps(engine)
        return None

    def _set_engine_steps(self, engine):
        """The counters into this rank's engine: one per engine entry (a bank's experts each at the bank's)."""
        engine.set_steps(self.steps, [self.entry_steps[i] for i, n in zip(self.positions, self.laid_counts)
                                      for _ in range(n)])

    def refresh(self, engine):
        """Collective. The owners' whole matrices from the parameters as they are now (their blocks, no
        gradients), and the engine's masters from them: before state is read or loaded, so a bf16 master
        follows the model (the first step's, or one written from outside since)."""
        if ("params",) not in self._plans:
            self._plans[("params",)] = [m for m in self._exchange_moves([True] * len(self.planned), True)
                                        if m[5] == "param"]
        self._move(self._plans[("params",)])
        engine.refresh_masters()

    def _first_nonfinite(self, has_grad):
        """(position, element of the whole tensor, value) of the first NaN/Inf gradient, the same on every
        rank, or None. Each distinct block is scanned by its sender only."""
        first, value = (len(self.planned), 0), 0.0
        # Which parameters have a gradient must be the same everywhere, or the exchanges would not pair up.
        pattern = hash(tuple(has_grad)) & ((1 << 61) - 1)
        scanned = [(i, _local(e.tensor.grad)) for i, (e, present) in enumerate(zip(self.planned, has_grad))
                   if present and self.sender[i][self.rank]]
        # One flag per gradient, read at once (on a GPU, one wait instead of one per parameter); only a
        # gradient found bad is searched for its first element.
        finite = torch.stack([torch.isfinite(g).all() for _, g in scanned]).tolist() if scanned else []
        for (i, g), ok in zip(scanned, finite):
            if not ok:
                e = self.planned[i]
                where = (~torch.isfinite(g)).nonzero()[0].tolist()  # the block's first in row-major order:
                element = 0  # ... the whole tensor's first in the block
                for (lo, _), k, n in zip(self.blocks[i][self.rank], where, e.shape):
                    element = element * n + lo + k
                first, value = (i, element), float(g[tuple(where)])
                break
        key = [first[0] * 2**40 + first[1], pattern, -pattern]
        if self.world > 1:  # (one rank: its own verdict, no collective)
            key = torch.tensor(key, dtype=torch.int64, device=self.comm_device)
            dist.all_reduce(key, op=dist.ReduceOp.MIN, group=self.group)
            self._count(24, 24)
            key = key.tolist()
        if key[1] != -key[2]:
            raise ValueError("the ranks disagree on which parameters have a gradient this step: every rank must "
                             "compute gradients for the same parameters (nothing was changed)")
        index, element = divmod(key[0], 2**40)
        if index == len(self.planned):
            return None
        if self.world == 1:
            return index, element, value
        mine = torch.tensor([value if (first[0], first[1]) == (index, element) else 0.0], dtype=torch.float64,
                            device=self.comm_device)
        dist.all_reduce(mine, group=self.group)  # NaN + 0 and inf + 0 keep their value
        self._count(8, 8)
        return index, element, float(mine)

    def _exchange(self, has_grad, inward):
        """inward: each distinct block of every NorMuon matrix (parameter, then gradient) from its sender to
        the matrix's owner, whose whole matrix takes it. Else the owners' new blocks to every rank that holds
        one (a matrix every rank holds whole: to every rank but the owner). One all_to_all; its plan is
        made once per pattern of gradients present."""
        key = (inward, tuple(has_grad))
        if key not in self._plans:
            if len(self._plans) > 16:  # (MoE: a few patterns of experts without gradients; not without bound)
                self._plans.clear()
            self._plans[key] = self._exchange_moves(has_grad, inward)
        self._move(self._plans[key])
        if inward:
            for i, proxy in self.proxies.items():  # a matrix without a gradient is not stepped
                proxy.grad = self.grads[i] if has_grad[i] else None

    def _exchange_moves(self, has_grad, inward):
        moves = []
        for i, (e, present) in enumerate(zip(self.planned, has_grad)):
            if e.algorithm != "normuon" or i in self.local or not present:
                continue
            o, local, blocks = self.owner[i], _local(e.tensor), self.blocks[i]
            if i not in self.proxies and self._whole_everywhere(i):
                if not inward:
                    moves += [(o, r, local.numel(), lambda t=local: t, lambda t=local: t, "out")
                              for r in range(self.world) if r != o]
                continue
            for r, b in enumerate(blocks):
                n = _numel(b)
                if inward and self.sender[i][r]:
                    moves.append((r, o, n, lambda t=local: t, lambda i=i, b=b: self.proxies[i][_slices(b)], "param"))
                    moves.append((r, o, n, lambda e=e: _local(e.tensor.grad),
                                  lambda i=i, b=b: self.grads[i][_slices(b)], "grad"))
                elif not inward and n:
                    moves.append((o, r, n, lambda i=i, b=b: self.proxies[i][_slices(b)], lambda t=local: t, "out"))
        return moves

    def _count(self, sent, received):
        """One collective: bytes to and from other ranks (what a rank keeps for itself is not counted)."""
        for stats in self._tallies:
            stats["collectives"] += 1
            stats["bytes_sent"] += sent
            stats["bytes_received"] += received

    def _move(self, moves):
        """moves: (source rank, destination rank, elements, what to send (called on the source), where it
        goes (called on the destination)), listed alike on every rank. One all_to_all_single, in fp32; none
        for an empty list (empty alike on every rank: DDP's inward exchange, anything on one rank)."""
        if not moves:
            return
        send = sorted((m for m in moves if m[0] == self.rank), key=lambda m: m[1])  # stable: the list's order
        recv = sorted((m for m in moves if m[1] == self.rank), key=lambda m: m[0])
        send_sizes, recv_sizes = [0] * self.world, [0] * self.world
        for m in send:
            send_sizes[m[1]] += m[2]
        for m in recv:
            recv_sizes[m[0]] += m[2]
        parts = [m[3]().reshape(-1).to(self.comm_device, torch.float32) for m in send if m[2]]
        send_buf = torch.cat(parts) if parts else torch.zeros(0, device=self.comm_device)
        if self.world == 1:  # (its moves to itself, in the same order: no collective)
            recv_buf = send_buf
        else:
            recv_buf = torch.empty(sum(recv_sizes), dtype=torch.float32, device=self.comm_device)
            dist.all_to_all_single(recv_buf, send_buf, recv_sizes, send_sizes, group=self.group)
            self._count(4 * (sum(send_sizes) - send_sizes[self.rank]), 4 * (sum(recv_sizes) - recv_sizes[self.rank]))
        at = 0
        for m in recv:
            if m[2]:
                dst = m[4]()
                dst.copy_(recv_buf[at:at + m[2]].view(dst.shape))
                at += m[2]

    # ------------------------------------------------------------------------------------------- state

    def state_layout(self, i):
        """Parameter i's state as one process holds it: (key, whole shape, this key's block on each rank),
        laid out as the parameter; a NorMuon second moment follows the parameter's blocks along its axis (a
        bank's, [E, len], along its experts too)."""
        e = self.planned[i]
        keys = ["momentum_buffer", "moment2_buffer"] if e.algorithm == "normuon" else ["exp_avg", "exp_avg_sq"]
        keys += ["master_param"] if e.low_precision else []
        out = []
        for key in keys:
            if key == "moment2_buffer":
                lead, axis = _moment2_dims(e)
                blocks = [b[:lead] + (b[axis],) for b in self.blocks[i]]
                out.append((key, tuple(e.shape[:lead]) + (e.stat_len,), blocks))
            else:
                out.append((key, tuple(e.shape), self.blocks[i]))
        return out

    def _placements(self, i, key):
        """The DTensor placements of parameter i's state `key`: the parameter's, or for the second moment
        its sharding along the statistics axis alone (as dimension 0), replicated elsewhere."""
        e = self.planned[i]
        if key != "moment2_buffer":
            return tuple(e.tensor.placements)
        from torch.distributed.tensor import Replicate

        lead, axis = _moment2_dims(e)
        out = []
        for p in e.tensor.placements:
            d = None if _shard_dim(p) is None else _shard_dim(p) % len(e.shape)
            if d is not None and (d < lead or d == axis):  # (a _StridedShard keeps its factor)
                to = d if d < lead else lead
                out.append(type(p)(to, split_factor=p.split_factor) if hasattr(p, "split_factor") else type(p)(to))
            else:
                out.append(Replicate())
        return tuple(out)

    def _views(self, engine):
        """position -> {key: this rank's engine view} of what its engine holds (whole matrices and banks it
        owns, local pieces of AdamW parameters)."""
        return {i: param_state(es) for i, es in zip(self.positions, by_parameter(engine.entries).values())}

    def local_state(self, engine):
        """Collective. Per position, {key: this rank's piece} (fresh fp32 tensors, the blocks state_layout
        gives): AdamW's from the local views, NorMuon's sent by each matrix's owner."""
        views, out, moves = self._views(engine), [], []
        for i, e in enumerate(self.planned):
            pieces = {}
            for key, shape, blocks in self.state_layout(i):
                if e.algorithm == "adamw" or i in self.local:  # held here, as its parameter is
                    pieces[key] = views[i][key].clone() if i in views else \
                        torch.zeros(tuple(hi - lo for lo, hi in blocks[self.rank]), device=_local(e.tensor).device)
                    continue
                mine = blocks[self.rank]
                pieces[key] = torch.empty(tuple(hi - lo for lo, hi in mine), dtype=torch.float32,
                                          device=_local(e.tensor).device)
                for r, b in enumerate(blocks):
                    moves.append((self.owner[i], r, _numel(b), lambda i=i, key=key, b=b: views[i][key][_slices(b)],
                                  lambda t=pieces[key]: t))
            out.append(pieces)
        self._move(moves)
        return out

    def whole(self, t):
        """A parameter's tensor or a state tensor, whole (a DTensor's gathered: collective)."""
        return t.full_tensor() if isinstance(t, dtensor_type() or ()) else t

    def dtensors(self, i, pieces):
        """Parameter i's state pieces (local_state) as DTensors of the whole shapes, laid out as the
        parameter (what torch.distributed.checkpoint saves and reshards); plain tensors held whole by every
        rank: the pieces as they are (the whole state)."""
        if not isinstance(self.planned[i].tensor, dtensor_type() or ()):
            return dict(pieces)
        mesh, out = self.planned[i].tensor.device_mesh, {}
        for key, shape, _ in self.state_layout(i):
            stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
            out[key] = dtensor_type().from_local(pieces[key], mesh, self._placements(i, key), run_check=False,
                                                 shape=torch.Size(shape), stride=stride)
        return out

    def local_pieces(self, i, given):
        """This rank's pieces of parameter i's state from a state dict's values ({key: DTensor, or a whole
        tensor}): a DTensor laid out otherwise is redistributed first (collective, alike on every rank)."""
        out = {}
        for key, shape, blocks in self.state_layout(i):
            t = given.get(key)
            if t is None:  # (a master_param left out: the master stays as it is)
                out[key] = None
                continue
            kind, mine = dtensor_type() or (), self.planned[i].tensor
            if isinstance(t, kind) and isinstance(mine, kind) and t.device_mesh == mine.device_mesh:
                if tuple(t.placements) != self._placements(i, key):
                    t = t.redistribute(t.device_mesh, self._placements(i, key))
                out[key] = t._local_tensor.to(torch.float32)
            else:  # a whole tensor, or a DTensor laid out on another mesh: its whole values, this rank's block
                out[key] = self.whole(t).to(torch.float32)[_slices(blocks[self.rank])]
        return out

    def load_local_state(self, engine, pieces, steps, entry_steps):
        """Collective. The inverse of local_state: each rank's pieces (per position, {key: tensor}) into the
        engine, each distinct block of NorMuon's to its matrix's owner; then the counters (group steps, each
        parameter's count)."""
        views, moves = self._views(engine), []
        for i, e in enumerate(self.planned):
            for key, shape, blocks in self.state_layout(i):
                piece = pieces[i][key]
                if piece is None:
                    continue
                if e.algorithm == "adamw" or i in self.local:
                    if i in views:  # (a bank without experts here has nothing to load)
                        views[i][key].copy_(piece.reshape(views[i][key].shape))
                    continue
                for r, (b, first) in enumerate(zip(blocks, _senders(blocks))):
                    if first:  # each distinct block once
                        moves.append((r, self.owner[i], _numel(b), lambda t=piece: t,
                                      lambda i=i, key=key, b=b: views[i][key][_slices(b)]))
        self._move(moves)
        self.steps, self.entry_steps = list(steps), list(entry_steps)
        self._set_engine_steps(engine)
        engine.mark_current()

    def load_whole(self, engine, whole, positions):
        """Collective. A one-process engine's parameters, state and counters (a state file every rank read)
        into this rank's blocks of the parameters and its engine; positions: where each of its entries lies
        in the plan (a parameter it leaves out, frozen and never stepped, stays as it is)."""
        given = [{} for _ in self.planned]
        entry_steps = list(self.entry_steps)
        counts = dict(zip(map(id, whole.entries), whole.entry_steps))
        with torch.no_grad():
            for i, ws in zip(positions, by_parameter(whole.entries).values()):
                _local(self.planned[i].tensor).copy_(ws[0].source.detach()[_slices(self.blocks[i][self.rank])])
                given[i], entry_steps[i] = param_state(ws), counts[id(ws[0])]
        self.refresh(engine)  # the owners' whole matrices from the parameters just written
        self.load_local_state(engine, [self.local_pieces(i, g) for i, g in enumerate(given)], whole.steps,
                              entry_steps)

