"""NorMuonAdamW over DTensor parameters on a 1-D device mesh: sharded by rows (Shard(0), FSDP2's
fully_shard) or replicated (Replicate(), data-parallel). The step of one process, bit for bit, with every
rank holding only its shards (docs/distributed.md).

AdamW and every elementwise pass run on the local shards: the engine binds each DTensor's local tensor and
reads its gradient's local shard. NorMuon needs whole matrices: each matrix has one owner rank, balanced by
the Newton-Schulz cost the core computes. Per step, one packed all_to_all hands every owner the rows of its
matrices (parameters and gradients); the owner's engine steps whole matrices, the arithmetic of one process;
one packed all_to_all returns the new rows to the shards. A replicated matrix is stepped by its owner where
it lies, and the same all_to_all hands every other rank its new values. A NaN/Inf gradient is found on every rank alike,
before anything changes (two small all_reduces), and the group counters follow the core's rule over the
whole model, so every rank reports the same.
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
    """Whether the planned parameters are DTensors (all of them: a mix is refused by Shards)."""
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
            if mesh.ndim != 1 or len(placements) != 1 or not (placements[0].is_shard(0) or placements[0].is_replicate()):
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
        # The whole model's layout: the counters of one process (the core's rule, _C.advance_steps).
        options = _C.Options([(name, algorithm) for name, algorithm, _ in groups])
        for i, v in enumerate(values):
            options.set_group(i, v)
        self.layout = _C.Layout.build(_C.Manifest(param_specs(planned, [name for name, _, _ in groups])), options)
        for e, le in zip(planned, self.layout.entries):  # the routing table's statistics axis
            e.stats_per_row, e.stat_len = le.stats_per_row, le.stat_len
        self.steps = [0] * len(values)
        self.entry_steps = [0] * len(planned)

    # ---------------------------------------------------------------------------------------- the step

    def step(self, engine, nonfinite):
        """One step of every rank (collective): the verdict, the exchange in, the engine's step, the
        exchange out, the counters. Returns the reason a skip_step policy skipped it, or None."""
        has_grad = [e.tensor.grad is not None for e in self.planned]
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
        index, element = divmod(int(key), 2**40)
        if index == len(self.planned):
            return None
        mine = torch.tensor([value if (first[0], first[1]) == (index, element) else 0.0], dtype=torch.float64)
        dist.all_reduce(mine, group=self.group)  # NaN + 0 and inf + 0 keep their value
        return index, element, float(mine)

    def _exchange(self, has_grad, inward):
        """inward: every rank's rows of each sharded NorMuon matrix (parameter, then gradient) to its owner, in
        one all_to_all; the owner's whole matrices take them. Else the owners' new rows back to the shards,
        and a replicated matrix's new values to every other rank."""
        import torch.distributed as dist

        send, send_sizes, recv_sizes, places = [], [0] * self.world, [0] * self.world, []
        for r in range(self.world):
            for i, (e, rows, present) in enumerate(zip(self.planned, self.rows, has_grad)):
                if e.algorithm != "normuon" or not present:
                    continue
                owner, cols = self.owner[i], math.prod(e.shape[1:])
                if rows is None:  # replicated: the owner has it all; afterwards everyone gets it all
                    if not inward and owner == self.rank and r != self.rank:
                        send.append(e.tensor._local_tensor.reshape(-1))
                        send_sizes[r] += e.tensor._local_tensor.numel()
                    if not inward and owner == r and r != self.rank:
                        recv_sizes[r] += e.tensor._local_tensor.numel()
                        places.append((i, 0, e.shape[0], False))
                    continue
                if inward and owner == r:  # my rows of r's matrix
                    local = e.tensor._local_tensor
                    send += [local.reshape(-1), e.tensor.grad._local_tensor.reshape(-1)]
                    send_sizes[r] += 2 * local.numel()
                if inward and owner == self.rank:  # r's rows of my matrix
                    recv_sizes[r] += 2 * rows[r] * cols
                    places.append((i, sum(rows[:r]), rows[r], True))
                if not inward and owner == self.rank:  # my new rows of r's part
                    start = sum(rows[:r])
                    send.append(self.proxies[i][start:start + rows[r]].reshape(-1))
                    send_sizes[r] += rows[r] * cols
                if not inward and owner == r:
                    recv_sizes[r] += rows[self.rank] * cols
                    places.append((i, 0, rows[self.rank], False))
        device = self.planned[0].tensor._local_tensor.device
        send_buf = torch.cat([t.to(torch.float32) for t in send]) if send else torch.zeros(0, device=device)
        recv_buf = torch.empty(sum(recv_sizes), dtype=torch.float32, device=device)
        dist.all_to_all_single(recv_buf, send_buf, recv_sizes, send_sizes, group=self.group)
        at = 0
        for index, start, n, to_proxy in places:
            e = self.planned[index]
            cols = math.prod(e.shape[1:])
            if to_proxy:
                proxy = self.proxies[index]
                proxy[start:start + n].copy_(recv_buf[at:at + n * cols].view(n, *e.shape[1:]))
                proxy.grad[start:start + n].copy_(recv_buf[at + n * cols:at + 2 * n * cols].view(n, *e.shape[1:]))
                at += 2 * n * cols
            else:
                e.tensor._local_tensor.copy_(recv_buf[at:at + n * cols].view(n, *e.shape[1:]))
                at += n * cols
        if inward:
            for index, proxy in self.proxies.items():  # a matrix without a gradient is not stepped
                proxy.grad = self.grads[index] if has_grad[index] else None
