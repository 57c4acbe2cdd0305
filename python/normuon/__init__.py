"""normuon: the NorMuon + AdamW hybrid optimizer for torch (docs/python.md).

    import normuon
    opt = normuon.NorMuonAdamW(model, lr=0.02, adamw_lr=3e-4)
    opt.print_routing()   # which parameter got NorMuon, which AdamW, and why
"""
from .distributed import DistributedNorMuonAdamW  # docs/distributed.md
from .native import StateFileError, native_error
from .optim import NorMuonAdamW
from .plan import route
from .routing import infer_role

__version__ = "0.1.0"


def native_available():
    """True when the native module normuon._C (the engine, state files) is importable."""
    return native_error() is None


__all__ = ["NorMuonAdamW", "StateFileError", "infer_role", "route", "native_available",
           "native_error", "__version__"]
