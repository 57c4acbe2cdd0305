"""The native modules: normuon._C (the core, the engine, the fast CPU backend) and, loaded when CUDA
parameters first ask for it, normuon._C_cuda. Everything the optimizer's rules need comes from here: the
fields of a group and their defaults, the checks of their values, the routing rule, the backend choice.
Python restates none of them."""
import importlib
import importlib.util

try:
    from . import _C

    _C_IMPORT_ERROR = None
except ImportError as error:  # the optimizer reports this when built, instead of silently downgrading
    _C = None
    _C_IMPORT_ERROR = f"{type(error).__name__}: {error}"


class StateFileError(RuntimeError):
    """Stand-in when the native module is missing; normally normuon._C.StateFileError."""


class OptionError(ValueError):
    """Stand-in when the native module is missing; normally normuon._C.OptionError: a refused option value,
    with its key (GROUP.FIELD), value (as the message writes it) and problem."""


if _C is not None:
    StateFileError, OptionError = _C.StateFileError, _C.OptionError  # noqa: F811


def native_error():
    """Why normuon._C could not be imported, or None."""
    return _C_IMPORT_ERROR


def require(what):
    """normuon._C, or RuntimeError saying that `what` needs it and why it is missing."""
    if _C is None:
        raise RuntimeError(f"{what} needs the native module normuon._C, which could not be imported "
                           f"({_C_IMPORT_ERROR}); build it (docs/python.md)")
    return _C


def fields(algorithm):
    """The hyper-parameter fields of a 'normuon' or 'adamw' group, in the core's order."""
    return tuple(require("NorMuonAdamW").fields(algorithm))


def defaults(algorithm):
    """{field: default} of a 'normuon' or 'adamw' group (options.h)."""
    return dict(require("NorMuonAdamW").Options().hyper(algorithm))


def check_values(group, algorithm, values):
    """{field: value} checked by the core (ValueError naming group.field), in canonical types."""
    return require("NorMuonAdamW").check_values(group, algorithm, values)


_CUDA_MODULE = []  # normuon._C_cuda, or why it cannot be had: looked up once, on first use


def cuda_module():
    """(normuon._C_cuda, None), or (None, why not). The fast CUDA backend is a module of its own, which links
    the CUDA runtime; it is imported here, when CUDA parameters first ask for it, so that `import normuon`
    and everything on the CPU work where there is no CUDA runtime at all."""
    if not _CUDA_MODULE:
        if _C is None:
            _CUDA_MODULE.append((None, f"the native module normuon._C is missing ({_C_IMPORT_ERROR})"))
        elif importlib.util.find_spec(__package__ + "._C_cuda") is None:
            _CUDA_MODULE.append((None, "this build of normuon has no CUDA backend (built without the CUDA toolkit, "
                                       "or with -DNORMUON_BUILD_CUDA=OFF)"))
        else:
            try:
                module = importlib.import_module(__package__ + "._C_cuda")
                _CUDA_MODULE.append((module, None))
            except ImportError as error:  # e.g. libcudart.so.13 is not on this machine
                _CUDA_MODULE.append((None, "the CUDA backend normuon._C_cuda could not be loaded: "
                                           f"{type(error).__name__}: {error}"))
    return _CUDA_MODULE[0]


def cuda_unavailable_reason(device=0):
    """Empty when the fast CUDA backend can run on that CUDA device index, else why not."""
    module, why = cuda_module()
    return why if module is None else module.cuda_unavailable_reason(device)
