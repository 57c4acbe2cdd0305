"""--device cpu: Megatron's CUDA-only code run on the CPU (also bench/megatron_pretrain_gpt.py --cpu-dry-run)."""
import contextlib
import time


class CpuDryRun:
    """Runs Megatron's CUDA-only code on the CPU: a torch function mode turns device='cuda' (and integer
    devices), .cuda() and .to('cuda') into the CPU, makes Tensor.type() answer 'torch.cuda.*Tensor' (Megatron's
    mixed-precision wrappers check it), and a few torch.cuda functions get stand-ins (current_device,
    current_stream, Stream, Event, stream, synchronize, device_count, empty_cache, memory counters). CUDA RNG
    states are not emulated: use model_parallel_cuda_manual_seed(..., inference_rng_tracker=True), whose tracker
    does not fork."""

    class _Stream:
        cuda_stream = 0

        def __init__(self, *a, **k):
            pass

        def wait_stream(self, *a, **k):
            pass

        def wait_event(self, *a, **k):
            pass

        def synchronize(self):
            pass

        def record_event(self, *a, **k):
            return CpuDryRun._Event()

    class _Event:
        def __init__(self, *a, **k):
            self.t = None

        def record(self, *a, **k):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def wait(self, *a, **k):
            pass

        def query(self):
            return True

        def elapsed_time(self, end):
            return 1000.0 * ((end.t or 0.0) - (self.t or 0.0))

    def __init__(self, claim_cuda_available=False):
        import torch
        from torch.overrides import TorchFunctionMode

        self.torch = torch

        def cpu(dev):
            if isinstance(dev, bool):
                return dev
            if isinstance(dev, int):
                return torch.device("cpu")
            if isinstance(dev, str) and dev.startswith("cuda"):
                return torch.device("cpu")
            if isinstance(dev, torch.device) and dev.type == "cuda":
                return torch.device("cpu")
            return dev

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = dict(kwargs or {})
                if "device" in kwargs:
                    kwargs["device"] = cpu(kwargs["device"])
                name = getattr(func, "__name__", "")
                if name in ("cuda", "pin_memory"):
                    return args[0]
                if name == "to" and len(args) > 1 and isinstance(args[1], (str, torch.device, int)):
                    args = (args[0], cpu(args[1])) + tuple(args[2:])
                out = func(*args, **kwargs)
                if (name == "type" and len(args) == 1 and not kwargs and isinstance(out, str)
                        and out.startswith("torch.") and ".cuda." not in out):
                    out = "torch.cuda." + out[len("torch."):]
                return out

        self.mode = Mode()
        self.patches = dict(current_device=lambda: 0, current_stream=lambda *a, **k: CpuDryRun._Stream(),
                            default_stream=lambda *a, **k: CpuDryRun._Stream(), Stream=CpuDryRun._Stream,
                            Event=CpuDryRun._Event, stream=lambda *a, **k: contextlib.nullcontext(),
                            synchronize=lambda *a, **k: None, device_count=lambda: 1, empty_cache=lambda: None,
                            memory_allocated=lambda *a, **k: 0, max_memory_allocated=lambda *a, **k: 0,
                            reset_peak_memory_stats=lambda *a, **k: None, set_device=lambda *a, **k: None,
                            get_rng_state=lambda *a, **k: torch.get_rng_state(),
                            set_rng_state=lambda state, *a, **k: torch.set_rng_state(state))
        if claim_cuda_available:  # megatron.training's initialize asserts it
            self.patches["is_available"] = lambda: True
        self.saved = {}

    def __enter__(self):
        import torch.cuda.random

        for k, v in self.patches.items():
            for module in (self.torch.cuda, torch.cuda.random):
                if module is self.torch.cuda or hasattr(module, k):
                    self.saved[(module, k)] = getattr(module, k, None)
                    setattr(module, k, v)
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        for (module, k), v in self.saved.items():
            setattr(module, k, v)
        return False
