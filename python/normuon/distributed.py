"""DistributedNorMuonAdamW: the name data-parallel code written for earlier versions uses. It is
NorMuonAdamW(params, process_group=group), the path FSDP2's DTensors take too (sharded.py,
docs/distributed.md): each NorMuon matrix has one owner rank, which runs its Newton-Schulz and sends the
new values to the others; every rank steps AdamW itself.
"""
import warnings

import torch.distributed as dist

from .optim import NorMuonAdamW


class DistributedNorMuonAdamW(NorMuonAdamW):
    """NorMuonAdamW over plain tensors that every rank of `process_group` (default: the world) holds whole,
    with the same (all-reduced) gradients: NorMuonAdamW(params, process_group=group, ...). step,
    state_dict, load_state_dict, export_state and import_state are collective.

    shard_adamw: gone (every rank steps AdamW on its own copy, which sends nothing); True warns."""

    def __init__(self, params=None, *args, process_group=None, shard_adamw=False, **kwargs):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DistributedNorMuonAdamW needs torch.distributed: call "
                               "torch.distributed.init_process_group() first (gloo on CPUs, nccl on GPUs)")
        if shard_adamw:
            warnings.warn("DistributedNorMuonAdamW: shard_adamw is gone: every rank steps AdamW itself, which sends "
                          "nothing (the result is the same)", FutureWarning, stacklevel=2)
        super().__init__(params, *args, process_group=dist.group.WORLD if process_group is None else process_group,
                         **kwargs)

    @property
    def process_group(self):
        return self._process_group

    @property
    def rank(self):
        return self._shards.rank

    @property
    def world_size(self):
        return self._shards.world

    def owned_names(self, rank=None):
        """Names of the matrices whose Newton-Schulz `rank` (default: this one) runs."""
        rank = self._shards.rank if rank is None else rank
        return [r["name"] for r in self.ownership_table() if r["owner"] == rank]
