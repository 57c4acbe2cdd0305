"""The native modules: normuon._C (core and fast CPU backend) never needs the CUDA runtime; the fast CUDA
backend is normuon._C_cuda, imported only when CUDA parameters ask for it, and a CUDA backend that cannot
be loaded is a reason, not a failed `import normuon`."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
normuon = pytest.importorskip("normuon")
from normuon import native, optim  # noqa: E402

needs_native = pytest.mark.skipif(optim._C is None, reason=f"the native module is missing ({optim.native_error()})")
CUDA_LIBRARIES = ("libcudart", "libcublas", "libcuda.so", "libnvrtc")


def _run(code, pythonpath, *args):
    env = dict(os.environ, PYTHONPATH=str(pythonpath), NORMUON_BACKEND="auto")
    # Run from the package's folder too: `python -c` puts the working directory first on sys.path.
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=pythonpath, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


# A CPU model stepped on the fast backend, and what that loaded: the CUDA backend's module, and shared
# objects of the CUDA toolkit mapped beyond those torch itself maps.
CPU_STEP = """
import sys
import torch
def cuda_objects():
    names = {line.split()[-1] for line in open('/proc/self/maps') if len(line.split()) >= 6}
    return {n for n in names if any(lib in n for lib in %r)}
before = cuda_objects()
import normuon
model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 11))
opt = normuon.NorMuonAdamW(model, lr=0.02)
model(torch.arange(5)).square().mean().backward()
opt.step()
print(opt.backend)
print('cuda module loaded:', 'normuon._C_cuda' in sys.modules)
print('new CUDA objects:', sorted(cuda_objects() - before))
from normuon import optim
print('reason:', optim.cuda_unavailable_reason(0))
""" % (CUDA_LIBRARIES,)


@needs_native
def test_core_module_does_not_link_the_cuda_runtime():
    if shutil.which("ldd") is None:
        pytest.skip("no ldd")
    needed = subprocess.run(["ldd", optim._C.__file__], capture_output=True, text=True).stdout
    assert not [line for line in needed.splitlines() if any(lib in line for lib in CUDA_LIBRARIES)], needed


@needs_native
def test_import_and_cpu_step_load_nothing_of_cuda():
    package_root = Path(optim.__file__).resolve().parent.parent
    out = _run(CPU_STEP, package_root)
    assert "cuda module loaded: False" in out, out
    assert "new CUDA objects: []" in out, out
    assert out.startswith("fast-cpu"), out


@needs_native
def test_a_cuda_backend_that_cannot_load_is_a_reason(tmp_path):
    """A copy of the package whose _C_cuda cannot be loaded (as where libcudart is missing): normuon imports,
    steps on the CPU, and says why the CUDA backend is unavailable."""
    source = Path(optim.__file__).resolve().parent
    package = tmp_path / "normuon"
    package.mkdir()
    for f in source.iterdir():
        if f.suffix in (".py", ".so") and not f.name.startswith("_C_cuda"):
            shutil.copyfile(f, package / f.name)  # copies: nothing here may write through to the build
    suffix = next(f.name[len("_C"):] for f in source.iterdir() if f.name.startswith("_C."))
    (package / ("_C_cuda" + suffix)).write_bytes(b"not a shared object")
    out = _run(CPU_STEP, tmp_path)
    assert out.startswith("fast-cpu"), out
    assert "reason: the CUDA backend normuon._C_cuda could not be loaded: ImportError" in out, out


@needs_native
def test_a_build_without_the_cuda_module_says_so(tmp_path):
    source = Path(optim.__file__).resolve().parent
    package = tmp_path / "normuon"
    package.mkdir()
    for f in source.iterdir():
        if f.suffix in (".py", ".so") and not f.name.startswith("_C_cuda"):
            shutil.copyfile(f, package / f.name)
    out = _run(CPU_STEP, tmp_path)
    assert "reason: this build of normuon has no CUDA backend" in out, out


@needs_native
def test_cuda_module_takes_the_core_modules_types():
    """_C_cuda works on a Layout and Options made by _C (types shared between the two modules)."""
    cuda, why = native.cuda_module()
    if cuda is None:
        pytest.skip(why)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 16),
                                torch.nn.Linear(16, 11))
    opt = normuon.NorMuonAdamW(model, lr=0.02)
    layout, options = opt.layout, opt.engine.options
    launches = cuda.cuda_launches_per_step(layout, options)
    assert isinstance(launches, int) and launches > 0
    assert isinstance(cuda.unsupported_reason(layout, options, 0), str)


@needs_native
def test_a_refused_value_carries_its_parts():
    """The core's refusal of a value is a ValueError that names its key, value and problem apart (callers
    that name values their own way, as the Megatron adapter, read them instead of parsing the message)."""
    with pytest.raises(native.OptionError) as caught:
        native.check_values("hidden", "normuon", {"beta1": 1.5})
    e = caught.value
    assert isinstance(e, ValueError) and (e.key, e.value, e.problem) == ("hidden.beta1", "1.5", "is outside [0, 1)")
    assert str(e) == "option 'hidden.beta1': 1.5 is outside [0, 1)"
    with pytest.raises(native.OptionError) as caught:
        native.check_values("hidden", "normuon", {"reduce_axis": "cols"})
    assert caught.value.value == "" and caught.value.problem.startswith("unknown value 'cols' (choose ")
