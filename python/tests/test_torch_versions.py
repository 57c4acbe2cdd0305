"""State dicts (torch.save) and state files cross between two torch versions (Debian's 1.13 and a current
2.x from PyPI, scripts/setup.sh): one interpreter trains and saves, the other resumes, and the result is bit
for bit the one an uninterrupted run gets. NORMUON_OTHER_PYTHON names the other interpreter (CTest sets it)."""
import os
import subprocess

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")

from conftest import require_native  # noqa: E402
import torch_version_worker as worker  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def other_python():
    path = os.environ.get("NORMUON_OTHER_PYTHON", "")
    if not path:
        pytest.skip("NORMUON_OTHER_PYTHON is not set (scripts/setup.sh makes .venv-torch2 and CTest passes it)")
    return path


def run_other(python, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    done = subprocess.run([python, os.path.join(HERE, "torch_version_worker.py"), *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    version = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], env=env,
                             capture_output=True, text=True, timeout=120).stdout.strip()
    return version


def uninterrupted(dtype):
    model, opt = worker.build(dtype)
    worker.train(model, opt, 1, 5)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("direction", ["other saves, this resumes", "this saves, other resumes"])
def test_state_crosses_torch_versions(tmp_path, dtype, direction):
    require_native()
    python = other_python()
    if direction.startswith("other"):
        other_version = run_other(python, "save", str(tmp_path), dtype)
        worker.resume(str(tmp_path), dtype)
    else:
        worker.save(str(tmp_path), dtype)
        other_version = run_other(python, "resume", str(tmp_path), dtype)
    assert other_version and other_version != torch.__version__, (other_version, torch.__version__)
    want = uninterrupted(dtype)
    for how in ("sd", "file"):
        got = torch.load(str(tmp_path / f"resumed-{how}.pt"))
        for n in want:
            assert torch.equal(got[n], want[n]), (how, n, torch.__version__, other_version)
