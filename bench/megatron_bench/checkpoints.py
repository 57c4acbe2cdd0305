"""Bench's checkpoints: saved and loaded as megatron.training.checkpointing does, in format 'torch'
(state_dict + torch.save) or 'torch_dist' (sharded_state_dict + dist_checkpointing), one rank."""
import os


class Checkpoints:
    """A mixin of Bench (self.torch, self.m: Megatron's modules)."""

    def sharded_metadata(self, b):
        md = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
              "dp_cp_group": self.m["parallel_state"].get_data_parallel_group(with_context_parallel=True)}
        # checkpointing._build_sharded_state_dict_metadata: the layer-wise optimizer chains a DistributedOptimizer for
        # the Adam groups, so it needs the sharding type too
        if b["config"].use_distributed_optimizer or b["config"].use_layer_wise_distributed_optimizer:
            md["distrib_optim_sharding_type"] = "dp_reshardable"
        return md

    def save(self, b, fmt, folder, iteration):
        """As megatron.training.checkpointing.save_checkpoint does for the format (one rank)."""
        torch = self.torch
        os.makedirs(folder, exist_ok=True)
        optimizer, cfg = b["optimizer"], b["config"]
        unwrapped = b["gpt"]  # checkpointing.save_checkpoint: model = unwrap_model(model) (no DDP, no Float16Module)
        if fmt == "torch":
            sd = {"checkpoint_version": 3.0, "iteration": iteration, "model": unwrapped.state_dict_for_save_checkpoint(),
                  "optimizer": optimizer.state_dict(), "opt_param_scheduler": b["scheduler"].state_dict()}
            torch.save(sd, os.path.join(folder, "model_optim_rng.pt"))
            if cfg.use_distributed_optimizer:
                optimizer.save_parameter_state(os.path.join(folder, "distrib_optim.pt"))
            if cfg.use_layer_wise_distributed_optimizer:
                optimizer.save_state_dict_to_file(os.path.join(folder, "layer_wise_optimizer_0.pt"))
        else:
            from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

            md = self.sharded_metadata(b)
            sd = {"checkpoint_version": 3.0, "iteration": iteration, "model": unwrapped.sharded_state_dict(metadata=md),
                  "opt_param_scheduler": b["scheduler"].state_dict()}
            sd["optimizer"] = optimizer.sharded_state_dict(sd, metadata=md)
            self.m["dist_checkpointing"].save(sd, folder, content_metadata=_clean_metadata_for_serialization(md))
        torch.distributed.barrier()

    def load(self, b, fmt, folder):
        """As megatron.training.checkpointing.load_checkpoint does for the format (one rank); returns the
        iteration."""
        torch = self.torch
        model, optimizer, cfg = b["model"], b["optimizer"], b["config"]
        if fmt == "torch":
            sd = torch.load(os.path.join(folder, "model_optim_rng.pt"), map_location="cpu", weights_only=False)
            model.load_state_dict(sd["model"], strict=True)
            if cfg.use_layer_wise_distributed_optimizer:
                optimizer.load_state_dict_from_file(os.path.join(folder, "layer_wise_optimizer_0.pt"))
            else:
                optimizer.load_state_dict(sd["optimizer"])
            if cfg.use_distributed_optimizer:
                optimizer.load_parameter_state(os.path.join(folder, "distrib_optim.pt"))
        else:
            dc = self.m["dist_checkpointing"]
            md = dc.load_content_metadata(folder) or {}
            md["dp_cp_group"] = self.m["parallel_state"].get_data_parallel_group(with_context_parallel=True)
            template = {"checkpoint_version": 3.0, "iteration": 0, "model": b["gpt"].sharded_state_dict(metadata=md),
                        "opt_param_scheduler": b["scheduler"].state_dict()}
            template["optimizer"] = optimizer.sharded_state_dict(template, is_loading=True, metadata=md)
            sd = dc.load(template, folder)
            model.load_state_dict(sd["model"], strict=True)
            optimizer.load_state_dict(sd["optimizer"])
        b["scheduler"].load_state_dict(sd["opt_param_scheduler"])
        return int(sd["iteration"])
