"""Small helpers: where the repository and the script are, a free port, class names, the optimizer tree,
--set values, medians and number formatting."""
import math
import os
import socket
import statistics

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(BENCH)
SCRIPT = os.path.join(BENCH, "megatron_gpt.py")  # what a child process of --isolate runs


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def qualname(obj):
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def optimizer_tree(optimizer):
    """ChainedOptimizer[LayerWiseDistributedOptimizer[Float16OptimizerWithFloat16Params(MegatronNorMuon)], ...]:
    Megatron's wrappers and the torch optimizers inside (bench/megatron_pretrain_gpt.py prints it too)."""
    name = type(optimizer).__name__
    if hasattr(optimizer, "chained_optimizers"):
        return f"{name}[{', '.join(optimizer_tree(o) for o in optimizer.chained_optimizers)}]"
    inner = getattr(optimizer, "optimizer", None)
    return f"{name}({qualname(inner) if inner is not None else 'None'})"


def parse_value(field, text):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def median(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else None


def fmt(x, spec=".4f"):
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)
