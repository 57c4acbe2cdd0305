"""pip packaging (pyproject.toml, setup.py): `pip install --no-build-isolation --no-deps --target DIR .` builds
normuon._C through CMake and installs a package that imports from DIR alone and steps on the fast backend.

The default test reuses the CMake build folder the tests import normuon from (NORMUON_CMAKE_BUILD_DIR:
`cmake --build --target _C` has nothing to do there), so it takes seconds. The build from scratch (a fresh
CMake folder, about a minute on two cores) runs with NORMUON_SLOW_TESTS=1."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import sys, torch, normuon
assert normuon.__file__.startswith(sys.argv[1]), normuon.__file__
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
opt = normuon.NorMuonAdamW(model.named_parameters(), lr=0.02)
before = [p.detach().clone() for p in model.parameters()]
model(torch.randn(5, 8)).square().mean().backward()
opt.step()
assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
import normuon.megatron
print(opt.backend, normuon.__version__)
"""


def pip_available():
    return subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0


def install_and_check(tmp_path, cmake_dir=None):
    if not pip_available():
        pytest.skip(f"pip is not available for {sys.executable}")
    target = tmp_path / "site"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NORMUON_CMAKE_BUILD_DIR")}
    env["PIP_NO_INDEX"] = "1"  # offline: nothing may come from an index
    if cmake_dir is not None:
        env["NORMUON_CMAKE_BUILD_DIR"] = str(cmake_dir)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                           "--disable-pip-version-check", "--target", str(target), str(ROOT)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    installed = sorted(p.name for p in (target / "normuon").iterdir())
    assert "megatron.py" in installed and any(n.startswith("_C.") for n in installed), installed
    if cmake_dir is not None and "NORMUON_BUILD_CUDA:BOOL=ON" in (cmake_dir / "CMakeCache.txt").read_text():
        assert any(n.startswith("_C_cuda.") for n in installed), installed  # the CUDA backend's module too
    env["PYTHONPATH"] = str(target)
    env.pop("NORMUON_BACKEND", None)
    run = subprocess.run([sys.executable, "-c", CHECK, str(target)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.split()[0] == "fast-cpu"


def test_pip_install_reusing_the_cmake_build(tmp_path):
    import normuon

    package = Path(normuon.__file__).resolve().parent
    build_dir = package.parent.parent  # <build>/python/normuon/__init__.py
    if not (build_dir / "CMakeCache.txt").exists() or not normuon.native_available():
        pytest.skip(f"normuon was not imported from a CMake build folder ({package})")
    install_and_check(tmp_path, cmake_dir=build_dir)


@pytest.mark.skipif(not os.environ.get("NORMUON_SLOW_TESTS"), reason="builds normuon._C from scratch (about a "
                    "minute); set NORMUON_SLOW_TESTS=1")
def test_pip_install_from_scratch(tmp_path):
    install_and_check(tmp_path)
