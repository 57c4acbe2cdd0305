"""A run's errors: recorded with their traceback, and Megatron's own limitations told apart from normuon's."""
import importlib
import os
import traceback


def reraise_interrupts(error):
    """Re-raises Ctrl-C and exits (KeyboardInterrupt, SystemExit, GeneratorExit); returns for anything else.
    A run catches BaseException to record and survive every error, including BaseExceptions that are errors in
    disguise (torch.distributed.checkpoint's CheckpointException derives from BaseException), and calls this
    first so that an interrupt or an exit still stops it."""
    if isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        raise error


class Failures:
    """A mixin of Bench (self.nm)."""

    def error(self, rec, stage, error):
        tb = traceback.format_exc()
        text = f"{stage}: {type(error).__name__}: {error}"
        upstream = self.megatron_limitation(rec, error)
        hint = None
        frames = [f.filename.replace(os.sep, "/") for f in traceback.extract_tb(error.__traceback__)]
        if (not upstream and any(f.endswith("normuon/megatron.py") for f in frames)
                and ("current device" in str(error) or "same device" in str(error))):
            hint = ("a device mismatch inside normuon.megatron: its split-QKV row index tensors (MegatronNorMuon._blocks) "
                    "and the parameter-shaped copies (_assemble) are made on the CPU; compare the normuon-nosplit run")
        rec["errors"].append({"stage": stage, "error": text, "traceback": tb[-4000:], "megatron_limitation": upstream,
                              "hint": hint})
        print(f"  ERROR in {text}\n" + "\n".join("    " + line for line in tb[-2500:].splitlines()), flush=True)
        if upstream:
            print(f"  (a limitation of Megatron itself, not of normuon: {upstream})", flush=True)
        return text

    def megatron_limitation(self, rec, error):
        """A reason when the error is one Megatron's own code raises in this configuration whatever the optimizer
        (so it is not normuon's); None otherwise. Only two precise cases are recognised."""
        frames = [f.filename.replace(os.sep, "/") for f in traceback.extract_tb(error.__traceback__)]
        version = self.nm.megatron_core_version()
        if isinstance(error, AttributeError) and "save_state_dict_to_file" in str(error):
            return (f"megatron-core {version}: with ckpt-format 'torch' and the layer-wise distributed optimizer, "
                    "megatron.training.checkpointing calls optimizer.save_state_dict_to_file(), which the "
                    "ChainedOptimizer([LayerWiseDistributedOptimizer, DistributedOptimizer]) built over DDP's layer-wise "
                    "parameter layout does not have; use torch_dist")
        distopt = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
        last = frames[-1] if frames else ""
        if (rec["variant"] == "adam" and rec["mode"] == "distopt" and not getattr(distopt, "HAVE_APEX_OR_TE", True)
                and last.endswith("megatron/core/optimizer/distrib_optimizer.py")
                and (isinstance(error, AssertionError) or (isinstance(error, KeyError) and "step" in str(error)))):
            return (f"megatron-core {version}: DistributedOptimizer over torch.optim.AdamW (no TE/Apex) cannot resume: "
                    "its state_dict() asserts one per-parameter 'step' and a fresh optimizer has none (torch_dist), "
                    "and load_parameter_state() looks for a 'step' the parameter-state file does not hold (torch)")
        if (rec["variant"] == "mcore-normuon" and isinstance(error, AttributeError) and "scale_mode" in str(error)
                and any("emerging_optimizers/" in f for f in frames)):
            try:
                from importlib import metadata

                eo_version = metadata.version("emerging-optimizers")
            except Exception:  # noqa: BLE001
                eo_version = "?"
            return (f"megatron-core {version} with emerging_optimizers {eo_version}: Emerging-Optimizers' "
                    "AdaptiveMuon.step() reads self.scale_mode, which Megatron's TensorParallelMuon never sets, so "
                    "Megatron's own adaptive_muon cannot step with this pair")
        return None
