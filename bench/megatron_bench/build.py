"""Bench's Megatron set-up: the process group, the seeds, and one variant's model and optimizer built as
megatron.training builds them, with what was built (wrappers, torch optimizers, routing)."""
import contextlib
import dataclasses
import os

from .helpers import free_port, optimizer_tree, parse_value, qualname
from .plan import EMERGING


class Build:
    """A mixin of Bench (self.args, self.torch, self.nm, self.m: Megatron's classes, self.mopt, self.eo,
    self.results)."""

    def init_distributed(self):
        torch, args = self.torch, self.args
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        if args.device == "cuda":
            torch.cuda.set_device(0)
        backend = args.dist_backend or ("nccl" if args.device == "cuda" else "gloo")
        torch.distributed.init_process_group(backend, init_method="env://", rank=0, world_size=1)
        self.m["parallel_state"].initialize_model_parallel(1, 1)
        self.results["setup"]["process_group_backend"] = backend

    def seed(self):
        torch = self.torch
        torch.manual_seed(self.args.seed)
        # force_reset: a fresh tracker per model, so every build (and every variant) starts from the same weights
        seed = self.m["tensor_parallel"].model_parallel_cuda_manual_seed
        try:
            seed(self.args.seed, inference_rng_tracker=self.args.device == "cpu", force_reset_rng=True)
        except TypeError:  # a megatron-core without force_reset_rng: reset() inside still clears the states
            seed(self.args.seed, inference_rng_tracker=self.args.device == "cpu")

    # ------------------------------------------------------------------ variants

    @contextlib.contextmanager
    def megatron_globals(self):
        """register()/replace_adam() set module globals of megatron.core.optimizer; restore them afterwards so
        every variant starts from Megatron as it was imported."""
        mopt, eo = self.mopt, self.eo
        saved = {k: getattr(mopt, k) for k in ("Adam", "USING_PYTORCH_OPTIMIZER", "HAVE_EMERGING_OPTIMIZERS")
                 if hasattr(mopt, k)}
        registry = dict(eo._EMERGING_OPTIMIZERS)
        try:
            yield
        finally:
            for k, v in saved.items():
                setattr(mopt, k, v)
            eo._EMERGING_OPTIMIZERS.clear()
            eo._EMERGING_OPTIMIZERS.update(registry)

    def optimizer_config(self, variant, mode, timers):
        a = self.args
        cfg = dict(lr=a.lr, min_lr=a.min_lr, weight_decay=a.weight_decay, bf16=True, params_dtype=self.torch.bfloat16,
                   adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=a.clip_grad, timers=timers,
                   muon_coefficient_type="simple")
        if variant in EMERGING:
            cfg["optimizer"] = {"normuon": "normuon", "normuon-nosplit": "normuon"}.get(variant, "adaptive_muon")
            cfg["use_layer_wise_distributed_optimizer"] = mode in ("layerwise", "layerwise-layout")
            cfg["use_distributed_optimizer"] = False  # what megatron.training's arguments do for emerging optimizers
        else:
            cfg["optimizer"] = "adam"
            cfg["use_distributed_optimizer"] = mode == "distopt"
        if variant == "normuon-nosplit":
            cfg["muon_split_qkv"] = False
        if variant == "mcore-normuon":
            cfg["adaptive_muon_moment2_method"] = "normuon"
        fields = {f.name for f in dataclasses.fields(self.m["OptimizerConfig"])}
        for item in a.config_set:
            key, _, value = item.partition("=")
            if key not in fields:
                raise ValueError(f"--set {item}: OptimizerConfig has no field {key!r}")
            cfg[key] = parse_value(key, value)
        cfg = {k: v for k, v in cfg.items() if k in fields}
        return self.m["OptimizerConfig"](**cfg)

    def patch_for(self, variant, backend=None):
        """Inside megatron_globals(): what the variant does to Megatron before get_megatron_optimizer()."""
        nm, backend = self.nm, backend or self.args.backend
        if variant in ("normuon", "normuon-nosplit"):
            nm.register("normuon", replace_adam=True, backend=backend)
        elif variant == "normuon-stock":
            nm.register("adaptive_muon", replace_existing=True, replace_adam=True, backend=backend)
        elif variant == "adamw":
            nm.replace_adam(backend=backend)
        elif variant == "mcore-normuon":
            if not self.mopt.HAVE_EMERGING_OPTIMIZERS:
                raise RuntimeError("Megatron's adaptive_muon needs the emerging_optimizers package (>= 0.2), which is "
                                   "not importable here: install .whl/emerging_optimizers-*.whl (Python 3.12)")

    # ------------------------------------------------------------------ building

    def build(self, variant, mode, backend=None):
        """Model (GPTModel, local spec, bf16, Float16Module, DDP), optimizer, scheduler, timers: one Megatron
        setup, as megatron.training's setup_model_and_optimizer wires it."""
        torch, a, m = self.torch, self.args, self.m
        self.seed()
        tcfg = m["TransformerConfig"](
            num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
            num_query_groups=a.num_query_groups, ffn_hidden_size=a.ffn_hidden_size, bf16=True,
            params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=a.device == "cpu", init_method_std=0.02)
        gpt = m["GPTModel"](config=tcfg, transformer_layer_spec=m["local_spec"](), vocab_size=a.vocab_size,
                            max_sequence_length=a.seq_length, position_embedding_type="rope",
                            share_embeddings_and_output_weights=False)
        if a.device == "cuda":
            gpt.cuda(torch.cuda.current_device())
        chunk = m["Float16Module"](tcfg, gpt)
        ddp_config = m["DDPConfig"](grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
                                    use_distributed_optimizer=False, check_for_nan_in_grad=True, bucket_size=None)
        layout = None
        if mode in ("distopt", "layerwise-layout"):
            ddp_config.use_distributed_optimizer = True
            params = [p for p in chunk.parameters() if p.requires_grad]
            if mode == "layerwise-layout":  # megatron.training.training.wrap_model_chunks_with_ddp, layer-wise branch
                from megatron.core.optimizer.layer_wise_optimizer import (LayerWiseDistributedOptimizer,
                                                                          tag_params_for_buffer_routing)
                tag_params_for_buffer_routing([chunk])
                layout = LayerWiseDistributedOptimizer.compute_full_param_layout(
                    params, None, 1, ddp_config, expert_data_parallel_world_size=1)
            else:
                from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
                layout = DistributedOptimizer.compute_full_param_layout(
                    params, None, 1, ddp_config, expert_data_parallel_world_size=1)
        kwargs = {"full_param_layout": layout} if layout is not None else {}
        model = m["DDP"](tcfg, ddp_config, chunk, **kwargs)
        timers = m["Timers"](2, "minmax")
        ocfg = self.optimizer_config(variant, mode, timers)
        with self.megatron_globals():
            self.patch_for(variant, backend)
            optimizer = m["get_megatron_optimizer"](ocfg, [model])
        # megatron.training's get_optimizer_param_scheduler: steps count samples (iterations x global batch)
        gbs = a.micro_batch_size
        scheduler = m["Scheduler"](
            optimizer, init_lr=0.0, max_lr=a.lr, min_lr=a.min_lr, lr_warmup_steps=a.lr_warmup_iters * gbs,
            lr_decay_steps=a.iters * gbs, lr_decay_style=a.lr_decay_style, start_wd=a.weight_decay,
            end_wd=a.weight_decay, wd_incr_steps=a.iters * gbs, wd_incr_style="constant")
        # what megatron.training.training.train() sets on the model config before the loop
        tcfg.grad_scale_func = optimizer.scale_loss
        tcfg.timers = timers
        tcfg.finalize_model_grads_func = m["finalize_model_grads"]
        tcfg.no_sync_func = model.no_sync
        return dict(model=model, gpt=gpt, optimizer=optimizer, scheduler=scheduler, timers=timers, config=ocfg,
                    tconfig=tcfg, variant=variant, mode=mode)

    def leaves(self, optimizer):
        """The Megatron optimizers that hold a torch optimizer (through ChainedOptimizer / LayerWise)."""
        if hasattr(optimizer, "chained_optimizers"):
            out = []
            for o in optimizer.chained_optimizers:
                out += self.leaves(o)
            return out
        return [optimizer]

    def describe(self, b):
        """What Megatron built: wrapper and torch optimizer classes, what each holds, the normuon backend, and
        whether normuon's matrices are exactly the parameters is_managed_by_layer_wise_optimizer picks."""
        opt = b["optimizer"]
        names = {}
        for name, p in b["model"].named_parameters():
            names[id(p)] = name
            main = getattr(p, "main_param", None)
            if main is not None:
                names[id(main)] = name
        out = {"top": qualname(opt), "tree": optimizer_tree(opt), "leaves": []}
        for leaf in self.leaves(opt):
            inner = getattr(leaf, "optimizer", None)
            entry = {"wrapper": qualname(leaf), "optimizer": qualname(inner) if inner is not None else None,
                     "groups": 0, "tensors": 0, "elements": 0, "matrices": 0, "names": []}
            if inner is not None:
                entry["groups"] = len(inner.param_groups)
                for g in inner.param_groups:
                    for p in g["params"]:
                        entry["tensors"] += 1
                        entry["elements"] += p.numel()
                        entry["matrices"] += int(p.dim() == 2)
                        entry["names"].append(names.get(id(p), f"<{tuple(p.shape)}>"))
                backend = getattr(inner, "backend", None)
                if backend is not None and not callable(backend):
                    entry["backend"] = str(backend)
                if hasattr(inner, "split_qkv"):
                    entry["split_qkv"] = bool(inner.split_qkv)
            out["leaves"].append(entry)
        # routing check (normuon variants): the matrices normuon got == Megatron's layer-wise predicate
        if b["variant"] in EMERGING:
            from megatron.core.optimizer.layer_wise_optimizer import is_managed_by_layer_wise_optimizer

            want = sorted(n for n, p in b["model"].named_parameters()
                          if p.requires_grad and is_managed_by_layer_wise_optimizer(p))
            got = sorted(n for e in out["leaves"] if e["optimizer"] and "Muon" in e["optimizer"] for n in e["names"])
            out["routing_check"] = {"muon_params": len(got), "layer_wise_predicate": len(want),
                                    "agree": got == want, "only_muon": sorted(set(got) - set(want))[:10],
                                    "only_predicate": sorted(set(want) - set(got))[:10]}
        qkv = [n for n, p in b["model"].named_parameters() if getattr(p, "is_qkv", False)]
        if qkv:
            p0 = dict(b["model"].named_parameters())[qkv[0]]
            out["qkv"] = {"params": len(qkv), "shape": list(p0.shape),
                          "qkv_split_shapes": list(getattr(p0, "qkv_split_shapes", []) or [])}
        return out
