"""Importing megatron-core and normuon: from the environment, else from a source tree or a build folder;
exit 2 with what was tried when neither works."""
import importlib
import os
import sys
import warnings

from .helpers import REPO


def fail_setup(message):
    print(f"megatron_gpt.py: {message}", file=sys.stderr)
    sys.exit(2)


def import_first(package, candidates, load):
    """load() with the environment's sys.path (candidate None), else with each candidate folder holding
    `package` put first on sys.path (and `package`'s modules dropped, so they load from there), until one
    works; a folder that failed is taken off sys.path again. Returns (load's result, the folder or None for
    the environment, tried), or (None, None, tried); `tried` says why each candidate failed."""
    tried = []
    for path in candidates:
        if path is not None:
            if not os.path.isdir(os.path.join(path, *package.split("."))):
                tried.append(f"{path}: no {package.replace('.', '/')} there")
                continue
            sys.path.insert(0, os.path.abspath(path))
            top = package.split(".")[0]
            for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
                del sys.modules[name]
        try:
            return load(), path, tried
        except Exception as error:  # noqa: BLE001 - ImportError, or a broken install: say which
            tried.append(f"{path or 'the environment (PYTHONPATH)'}: {type(error).__name__}: {error}")
            if path is not None:
                sys.path.remove(os.path.abspath(path))
    return None, None, tried


def import_megatron(args):
    """megatron.core from the environment, else from --megatron-path / REPO/.megatron-lm; exit 2 otherwise."""
    os.environ.setdefault("NO_VCS_VERSION", "1")  # the source tree's package_info would run git in its folder

    def load():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            core = importlib.import_module("megatron.core")
            importlib.import_module("megatron.core.optimizer")
            importlib.import_module("megatron.core.models.gpt")
            importlib.import_module("megatron.core.distributed")
        captured = sorted({str(w.message) for w in caught if str(w.message).startswith(
            ("Transformer Engine and Apex are not installed", "Apex is not installed"))})
        return core, captured

    paths = [args.megatron_path] if args.megatron_path else [None, os.path.join(REPO, ".megatron-lm")]
    loaded, path, tried = import_first("megatron.core", paths, load)
    if loaded is not None:
        core, captured = loaded
        return core, (path or "environment"), captured
    fail_setup("megatron-core is not importable:\n  " + "\n  ".join(tried) + "\n"
               "Install it (megatron-core 0.18-0.20; the wheels need Python 3.12), e.g. from the wheels carried in .whl:\n"
               "  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
               "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site\n"
               "or carry a Megatron-LM source tree and pass --megatron-path DIR (pure Python: megatron/core needs only "
               "torch, numpy and packaging).")


def import_normuon(args):
    def load():
        normuon = importlib.import_module("normuon")
        nm = importlib.import_module("normuon.megatron")
        native = normuon.optim.native_error() if hasattr(normuon, "optim") else None
        if native is not None:
            raise ImportError(f"normuon._C: {native}")
        return normuon, nm, os.path.dirname(os.path.dirname(os.path.abspath(normuon.__file__)))

    candidates = [args.normuon_path] if args.normuon_path else [None, os.path.join(REPO, "build-gpu", "python"),
                                                                os.path.join(REPO, "build", "python")]
    loaded, _, tried = import_first("normuon", candidates, load)
    if loaded is not None:
        return loaded
    fail_setup("the normuon package (with its native module normuon._C) is not importable:\n  " + "\n  ".join(tried)
               + "\nBuild it (cmake, e.g. scripts/gpu-test.sh --build-only puts it in build-gpu/python) and put its "
                 "folder on PYTHONPATH or pass --normuon-path.")
