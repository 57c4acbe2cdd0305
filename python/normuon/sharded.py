"""NorMuonAdamW over DTensor parameters on a 1-D device mesh: sharded by rows (Shard(0), FSDP2's
fully_shard) or replicated (Replicate(), data-parallel). The step of one process, bit for bit, with every
rank holding only its shards (docs/distributed.md).

AdamW and every elementwise pass run on the local shards: the engine binds each DTensor's local tensor and
reads its gradient's local shard. NorMuon needs whole matrices: each matrix has one owner rank, balanced by
the Newton-Schulz cost the core computes. Per step, one packed all_to_all hands every owner the rows of its
matrices (parameters and gradients); the owner's engine steps whole matrices, the arithmetic of one process;
one packed all_to_all returns the new rows to the shards. A replicated matrix is stepped by its owner where
it lies, and the same all_to_all hands every other rank its new values. A NaN/Inf gradient is found on
every rank alike, before anything changes (a small all_reduce), and the group counters follow the core's
rule over the whole model, so every rank reports the same. State dicts are DTensors laid out as their
parameters, for torch.distributed.checkpoint.
"""
import copy
import math

import torch

from .engine import param_specs
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


def chunk_rows(rows, world):
    """Rows per rank as torch.chunk cuts dim 0 (FSDP2's Shard(0)): ceil(rows / world) each, the last ones
    shorter or empty."""
    size = -(-rows // world) if rows else 0
    return [max(0, min(size, rows - r * size)) for r in range(world)]


class Shards:
    """The sharded layout of one optimizer: which rank owns which NorMuon matrix, the entries this rank's
    engine steps, the exchange, the NaN/Inf verdict and the group counters of the whole model.

    planned: the optimizer's planned entries (global shapes, their tensors DTensors); groups: (name,
    algorithm, checked values) per group, as the engine takes them."""

    def __init__(self, planned, groups):
        import torch.distributed as dist

        kind = dtensor_type()
        mesh = None
        for e in planned:
            where = f"parameter '{e.name}'"
            if not isinstance(e.tensor, kind):
                raise ValueError(f"{where} is a plain tensor beside DTensor parameters: shard every parameter (FSDP2's "
                                 "fully_shard on the model) or none")
            if mesh is None:
                mesh = e.tensor.device_mesh
            elif e.tensor.device_mesh != mesh:
                raise ValueError(f"{where} lies on another device mesh than '{planned[0].name}': one mesh for all")
            placements = tuple(e.tensor.placements)
            served = len(placements) == 1 and (placements[0].is_shard(0) or placements[0].is_replicate())
            if mesh.ndim != 1 or not served:
                raise ValueError(f"{where} has placements {placements} on a {mesh.ndim}-D mesh; served: Shard(0) "
                                 "(FSDP2's fully_shard) or Replicate() on a 1-D mesh. FSDP x TP meshes and Partial "
                                 "come later")
            if e.block is not None:
                raise ValueError(f"{where}: blocks of rows of a sharded parameter are not served")
        self.group = mesh.get_group()
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.planned = planned
        # Rows per rank of a sharded parameter; None for a replicated one (every rank holds all of it).
        self.rows = [None if e.tensor.placements[0].is_replicate() else
                     chunk_rows(e.shape[0], self.world) if e.shape else [0] * self.world for e in planned]
        for e, rows in zip(planned, self.rows):
            local = tuple(e.tensor._local_tensor.shape)
            if rows is not None and e.shape and local != (rows[self.rank],) + tuple(e.shape[1:]):
                raise ValueError(f"parameter '{e.name}' has a local shard of shape {list(local)} on rank {self.rank}; "
                                 f"Shard(0) as torch.chunk cuts it would give {rows[self.rank]} rows: uneven custom "
                                 "sharding is not served")
        matrices = [e for e in planned if e.algorithm == "normuon"]
        values = [v for _, _, v in groups]
        costs = [newton_schulz_flops(e.shape[0], e.shape[1], values[e.group]["ns_steps"],
                                     values[e.group].get("ns_algorithm", "standard")) for e in matrices]
        owners, _ = assign_owners(costs, self.world)
        at = {id(e): i for i, e in enumerate(planned)}  # everything below is keyed by position in `planned`
        self.owner = {at[id(e)]: r for e, r in zip(matrices, owners)}
        self.matrices = matrices
        self.entries = []  # what this rank's engine steps, in manifest order
        self.positions = []  # of each of them in `planned`
        self.proxies = {}  # position -> the whole matrix an owner steps
        self.grads = {}    # position -> its gradient buffer (the proxy's .grad when the matrix has a gradient)
        for i, e in enumerate(planned):
            mine = copy.copy(e)
            if e.algorithm == "normuon" and self.owner[i] != self.rank:
                continue
            if e.algorithm == "normuon" and self.rows[i] is not None:  # whole here, from the shards
                mine.tensor = torch.zeros(e.shape, dtype=e.dtype, device=e.tensor._local_tensor.device)
                self.grads[i] = mine.tensor.grad = torch.zeros_like(mine.tensor)
                self.proxies[i] = mine.tensor
            else:
                mine.tensor = e.tensor._local_tensor
                mine.shape = tuple(mine.tensor.shape)
                mine.grad_of = e.tensor
            self.entries.append(mine)
            self.positions.append(i)
        # The whole model's layout: the counters of one process (the core's rule, _C.advance_steps).
        options = _C.Options([(name, algorithm) for name, algorithm, _ in groups])
        for i, v in enumerate(values):
            options.set_group(i, v)
        self.layout = _C.Layout.build(_C.Manifest(param_specs(planned, [name for name, _, _ in groups])), options)
        for e, le in zip(planned, self.layout.entries):  # the routing table's statistics axis
            e.stats_per_row, e.stat_len = le.stats_per_row, le.stat_len
        self.steps = [0] * len(values)
        self.entry_steps = [0] * len(planned)
        # Bytes this rank sent and received through torch.distributed: in all, and in the last step.
        self.comm_stats = dict(steps=0, collectives=0, bytes_sent=0, bytes_received=0)
        self.last_step_comm = dict(collectives=0, bytes_sent=0, bytes_received=0)
        self._agree(planned)

    # ---------------------------------------------------------------------------------------- the step

    def step(self, engine, nonfinite):
        """One step of every rank (collective): the verdict, the exchange in, the engine's step, the
        exchange out, the counters. Returns the reason a skip_step policy skipped it, or None."""
        has_grad = [e.tensor.grad is not None for e in self.planned]
        self.last_step_comm = dict(collectives=0, bytes_sent=0, bytes_received=0)
        self.comm_stats["steps"] += 1
        bad = self._first_nonfinite(has_grad)
        if bad is not None:
            index, element, value = bad
            e = self.planned[index]
            return _C.nonfinite_gradient(e.name, value, element, self.steps[e.group] + 1, nonfinite)
        self._exchange(has_grad, inward=True)
        skipped = engine.step()
        if skipped is not None:  # (every gradient was checked above, on every rank)
            raise RuntimeError(f"rank {self.rank}: the engine skipped a step the ranks agreed on: {skipped}")
        self._exchange(has_grad, inward=False)
        self.steps, self.entry_steps = _C.advance_steps(self.layout, has_grad, self.steps, self.entry_steps)
        engine.set_steps(self.steps, engine.entry_steps)
        return None

    def _first_nonfinite(self, has_grad):
        """(position, element of the whole tensor, value) of the first NaN/Inf gradient, the same on every
        rank, or None."""
        import torch.distributed as dist

        first, value = (len(self.planned), 0), 0.0
        for i, (e, rows, present) in enumerate(zip(self.planned, self.rows, has_grad)):
            if not present or (rows is None and self.rank != 0):  # a replicated gradient: rank 0 answers
                continue
            g = e.tensor.grad._local_tensor.reshape(-1)
            bad = (~torch.isfinite(g)).nonzero()
            if bad.numel():
                k = int(bad[0])
                start = sum(rows[:self.rank]) * math.prod(e.shape[1:]) if rows is not None else 0
                first, value = (i, start + k), float(g[k])
                break
        key = torch.tensor([first[0] * 2**40 + first[1]], dtype=torch.int64)
        dist.all_reduce(key, op=dist.ReduceOp.MIN, group=self.group)
        self._count(8 * (self.world > 1), 8 * (self.world > 1))
        index, element = divmod(int(key), 2**40)
        if index == len(self.planned):
            return None
        mine = torch.tensor([value if (first[0], first[1]) == (index, element) else 0.0], dtype=torch.float64)
        dist.all_reduce(mine, group=self.group)  # NaN + 0 and inf + 0 keep their value
        self._count(8 * (self.world > 1), 8 * (self.world > 1))
        return index, element, float(mine)

    def _exchange(self, has_grad, inward):
        """inward: every rank's rows of each sharded NorMuon matrix (parameter, then gradient) to its owner;
        the owner's whole matrix takes them. Else the owners' new rows back to the shards, and a replicated
        matrix's new values to every other rank. One all_to_all."""
        moves = []
        for i, (e, rows, present) in enumerate(zip(self.planned, self.rows, has_grad)):
            if e.algorithm != "normuon" or not present:
                continue
            o, local = self.owner[i], e.tensor._local_tensor
            if rows is None:  # replicated: the owner has it all; afterwards everyone gets it all
                if not inward:
                    moves += [(o, r, local.numel(), lambda t=local: t, lambda t=local: t)
                              for r in range(self.world) if r != o]
                continue
            cols = math.prod(e.shape[1:])
            for r in range(self.world):
                part = lambda i=i, r=r, grad=False: self._rows(self.grads[i] if grad else self.proxies[i], i, r)
                if inward:
                    moves.append((r, o, rows[r] * cols, lambda t=local: t, part))
                    moves.append((r, o, rows[r] * cols, lambda e=e: e.tensor.grad._local_tensor,
                                  lambda part=part: part(grad=True)))
                else:
                    moves.append((o, r, rows[r] * cols, part, lambda t=local: t))
        self._move(moves)
        if inward:
            for i, proxy in self.proxies.items():  # a matrix without a gradient is not stepped
                proxy.grad = self.grads[i] if has_grad[i] else None

    def _count(self, sent, received):
        """One collective: bytes to and from other ranks (what a rank keeps for itself is not counted)."""
        for stats in (self.comm_stats, self.last_step_comm):
            stats["collectives"] += 1
            stats["bytes_sent"] += sent
            stats["bytes_received"] += received

    def _agree(self, planned):
        """Every rank of the mesh holds the same parameter list (names, shapes, dtypes, routing): else a
        ValueError on every rank alike, naming the first difference, instead of a collective that hangs."""
        import torch.distributed as dist

        mine = [(e.name, tuple(e.shape), str(e.dtype), e.algorithm) for e in planned]
        every = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        for r, theirs in enumerate(every):
            if theirs != mine:
                diff = next((f"'{a[0]}' {a[1:]} here, '{b[0]}' {b[1:]} on rank {r}" for a, b in zip(mine, theirs)
                             if a != b), f"{len(mine)} parameters here, {len(theirs)} on rank {r}")
                raise ValueError(f"the ranks of the mesh disagree on the parameters ({diff}): build the optimizer "
                                 "over the same model on every rank")

    def _rows(self, whole, i, r):
        """Rank r's rows of the whole tensor `whole` laid out as parameter i is sharded."""
        start = sum(self.rows[i][:r])
        return whole[start:start + self.rows[i][r]]

    def _move(self, moves):
        """moves: (source rank, destination rank, elements, what to send (called on the source), where it
        goes (called on the destination)), listed alike on every rank. One all_to_all_single, in fp32."""
        import torch.distributed as dist

        send = sorted((m for m in moves if m[0] == self.rank), key=lambda m: m[1])  # stable: the list's order
        recv = sorted((m for m in moves if m[1] == self.rank), key=lambda m: m[0])
        send_sizes, recv_sizes = [0] * self.world, [0] * self.world
        for m in send:
            send_sizes[m[1]] += m[2]
        for m in recv:
            recv_sizes[m[0]] += m[2]
        device = self.planned[0].tensor._local_tensor.device
        parts = [m[3]().reshape(-1).to(torch.float32) for m in send if m[2]]
        send_buf = torch.cat(parts) if parts else torch.zeros(0, device=device)
        recv_buf = torch.empty(sum(recv_sizes), dtype=torch.float32, device=device)
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
        """Parameter i's state as one process holds it: (key, global shape, sharded by rows), with the
        placement that follows (the parameter's; a NorMuon second moment along the columns is replicated)."""
        e = self.planned[i]
        sharded = self.rows[i] is not None
        if e.algorithm == "normuon":
            keys = [("momentum_buffer", e.shape, sharded),
                    ("moment2_buffer", (e.stat_len,), sharded and e.stats_per_row)]
        else:
            keys = [("exp_avg", e.shape, sharded), ("exp_avg_sq", e.shape, sharded)]
        if e.low_precision:
            keys.append(("master_param", e.shape, sharded))
        return keys

    def _views(self, engine):
        """position -> {key: this rank's engine view} of what its engine holds (whole matrices it owns,
        local shards of AdamW parameters)."""
        out = {}
        for i, me in zip(self.positions, engine.entries):
            names = ("momentum_buffer", "moment2_buffer") if me.algorithm == "normuon" else ("exp_avg", "exp_avg_sq")
            out[i] = dict(zip(names, me.state))
            if me.low_precision:
                out[i]["master_param"] = me.master
        return out

    def local_state(self, engine):
        """Collective. Per position, {key: this rank's piece} (fresh fp32 tensors, laid out as state_layout
        says): AdamW's from the local views, NorMuon's sent by each matrix's owner."""
        views, out, moves = self._views(engine), [], []
        for i, e in enumerate(self.planned):
            pieces = {}
            for key, shape, sharded in self.state_layout(i):
                rows = self.rows[i][self.rank] if sharded else (shape[0] if shape else 0)
                if e.algorithm == "adamw":
                    pieces[key] = views[i][key].clone()
                    continue
                pieces[key] = torch.empty((rows,) + tuple(shape[1:]), dtype=torch.float32,
                                          device=e.tensor._local_tensor.device)
                o, cols = self.owner[i], math.prod(shape[1:])
                for r in range(self.world):
                    n = (self.rows[i][r] if sharded else shape[0]) * cols
                    whole = lambda i=i, key=key: views[i][key]
                    src = (lambda whole=whole, i=i, r=r: self._rows(whole(), i, r)) if sharded else whole
                    moves.append((o, r, n, src, lambda t=pieces[key], r=r: t))
            out.append(pieces)
        self._move(moves)
        return out

    def _placement(self, sharded):
        from torch.distributed.tensor import Replicate, Shard

        return [Shard(0)] if sharded else [Replicate()]

    def dtensors(self, i, pieces):
        """Parameter i's state pieces (local_state) as DTensors of the whole shapes, laid out as the
        parameter (what torch.distributed.checkpoint saves and reshards)."""
        mesh, out = self.planned[i].tensor.device_mesh, {}
        for key, shape, sharded in self.state_layout(i):
            stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
            out[key] = dtensor_type().from_local(pieces[key], mesh, self._placement(sharded), run_check=False,
                                                 shape=torch.Size(shape), stride=stride)
        return out

    def local_pieces(self, i, given):
        """This rank's pieces of parameter i's state from a state dict's values ({key: DTensor, or a whole
        tensor}): a DTensor laid out otherwise is redistributed first (collective, alike on every rank)."""
        out = {}
        for key, shape, sharded in self.state_layout(i):
            t = given.get(key)
            if t is None:  # (a master_param left out: the master stays as it is)
                out[key] = None
                continue
            if isinstance(t, dtensor_type()):
                if tuple(t.placements) != tuple(self._placement(sharded)):
                    t = t.redistribute(t.device_mesh, self._placement(sharded))
                out[key] = t._local_tensor.to(torch.float32)
            else:
                t = t.to(torch.float32)
                out[key] = self._rows(t, i, self.rank) if sharded else t
        return out

    def load_local_state(self, engine, pieces, steps, entry_steps):
        """Collective. The inverse of local_state: each rank's pieces (per position, {key: tensor}) into the
        engine, NorMuon's to each matrix's owner; then the counters (group steps, each parameter's count)."""
        views, moves = self._views(engine), []
        for i, e in enumerate(self.planned):
            for key, shape, sharded in self.state_layout(i):
                piece = pieces[i][key]
                if piece is None:
                    continue
                if e.algorithm == "adamw":
                    views[i][key].copy_(piece.reshape(views[i][key].shape))
                    continue
                o, cols = self.owner[i], math.prod(shape[1:])
                for r in range(self.world):
                    n = (self.rows[i][r] if sharded else shape[0]) * cols
                    if not sharded and r != 0:
                        continue  # a replicated piece: rank 0's
                    dst = (lambda i=i, key=key, r=r: self._rows(views[i][key], i, r)) if sharded else \
                        (lambda i=i, key=key: views[i][key])
                    moves.append((r, o, n, lambda t=piece: t, dst))
        self._move(moves)
        self.steps, self.entry_steps = list(steps), list(entry_steps)
        engine.set_steps(self.steps, [self.entry_steps[i] for i in self.positions])
        engine.mark_current()
