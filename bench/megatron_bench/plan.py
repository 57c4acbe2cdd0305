"""What runs: the optimizer variants, how each distributes the optimizer, the checkpoint formats and the
timers read; the (variant spec, mode) pairs to run and a run's record before it runs."""

VARIANTS = {
    "adam": "Megatron's Adam as Megatron picks it (TE/Apex FusedAdam, else torch.optim.AdamW)",
    "normuon": "register('normuon', replace_adam=True); optimizer='normuon', muon_coefficient_type='simple'",
    "normuon-stock": "register('adaptive_muon', replace_existing=True, replace_adam=True); optimizer='adaptive_muon' "
                     "(the stock pretrain_gpt.py route)",
    "normuon-nosplit": "as normuon, with muon_split_qkv=False",
    "adamw": "replace_adam() only; optimizer='adam' builds normuon's MegatronAdamW",
    "mcore-normuon": "Megatron's own adaptive_muon (TensorParallelAdaptiveMuon) with moment2_method='normuon', "
                     "coefficients 'simple' (needs emerging_optimizers)",
}
EMERGING = {"normuon", "normuon-stock", "normuon-nosplit", "mcore-normuon"}
OURS = {"normuon", "normuon-stock", "normuon-nosplit", "adamw"}  # these take a normuon backend: NAME@BACKEND
BACKENDS = ("auto", "fast", "reference")


# How a run distributes the optimizer (one process, so "distributed" means Megatron's code paths, not sharding):
MODES = {
    "off": ("", "", "no distributed optimizer"),
    "distopt": ("+distopt", "+do", "DistributedOptimizer (use_distributed_optimizer) with DDP's parameter layout"),
    "layerwise": ("+layerwise", "+lw", "LayerWiseDistributedOptimizer, legacy ping-pong path (every parameter in it, DDP "
                  "without the distributed optimizer): what pretrain_gpt.py --use-distributed-optimizer builds in "
                  "megatron-core 0.19"),
    "layerwise-layout": ("+layerwise-layout", "+lwl", "LayerWiseDistributedOptimizer for the matrices + "
                         "DistributedOptimizer for the Adam groups over DDP's layer-wise parameter layout "
                         "(megatron.training.training.wrap_model_chunks_with_ddp)"),
}

FORMATS = ("torch", "torch_dist")
# The timers Megatron's optimizers start inside step() (optimizer.py), and the one train_step puts around it.
OPTIMIZER_TIMERS = ("optimizer", "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf",
                    "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
                    "optimizer-copy-main-to-model-params", "params-all-gather", "forward-backward")


def run_plan(args):
    """The (variant spec, mode) pairs to run, in order."""
    plan = []
    for spec in args.variants:
        name, _ = split_spec(spec)
        for distopt in args.distopt:
            if not distopt:
                plan.append((spec, "off"))
            elif name in EMERGING:
                plan += [(spec, m) for m in {"ping-pong": ["layerwise"], "layout": ["layerwise-layout"],
                                             "both": ["layerwise", "layerwise-layout"]}[args.layer_wise]]
            else:
                plan.append((spec, "distopt"))
    return plan


def split_spec(spec):
    """'normuon-nosplit@reference' -> ('normuon-nosplit', 'reference'); 'adam' -> ('adam', None)."""
    name, _, backend = spec.partition("@")
    return name, (backend or None)


def new_record(spec, mode):
    """A run's record before it runs."""
    name, backend = split_spec(spec)
    return {"label": spec + MODES[mode][0], "variant": name, "backend": backend, "mode": mode,
            "distributed_optimizer": mode != "off",
            "what": VARIANTS[name] + ("" if mode == "off" else "; " + MODES[mode][2]),
            "iterations": [], "errors": [], "resume": {}}
