"""The example trains: the loss printed at the end is well below the first."""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")

from conftest import require_native, torch_bf16_matmul_error  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "train_tiny.py")


@pytest.mark.parametrize("args", [["--steps", "15"], ["--steps", "15", "--bf16", "--backend", "reference"]],
                         ids=["fast-fp32", "reference-bf16"])
def test_train_tiny_example(args, tmp_path):
    if "reference" not in args:
        require_native()
    if "--bf16" in args and torch_bf16_matmul_error():
        pytest.skip(torch_bf16_matmul_error())  # the model's own forward, not the optimizer
    out = subprocess.run([sys.executable, EXAMPLE, *args, "--save", str(tmp_path / "s.safetensors")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out.stdout)]
    assert len(losses) == 15 and losses[-1] < 0.6 * losses[0], out.stdout
    assert "blocks.0.mlp.0.weight" in out.stdout and (tmp_path / "s.safetensors").exists()


@pytest.mark.parametrize("layout,ranks", [("fsdp2", 2), ("ddp", 2), ("fsdp-tp", 4)])
def test_train_fsdp2_example(tmp_path, layout, ranks):
    """docs/distributed.md's examples: spawned CPU ranks train under FSDP2, DDP (process_group=) and FSDP x TP
    on a 2 x 2 mesh, save with torch.distributed.checkpoint and load the checkpoint back into a fresh model and
    optimizer."""
    require_native()
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except (ImportError, ValueError):  # torch 1.13 (on Python 3.11 its import fails with a ValueError)
        pytest.skip("this torch has no FSDP2")
    example = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "train_fsdp2.py")
    out = subprocess.run([sys.executable, example, "--spawn", str(ranks), "--layout", layout, "--steps", "30",
                          "--checkpoint", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out.stdout)]
    assert len(losses) == 30 and losses[-1] < 0.85 * losses[0], out.stdout
    assert "parameters equal" in out.stdout and (tmp_path / "dcp").is_dir(), out.stdout


def test_train_fsdp2_example_launched(tmp_path):
    """The same example as a launcher (torchrun) starts it: the rendezvous from the environment, here one rank;
    without --checkpoint it stops with a clear message (launched ranks need a folder they share)."""
    require_native()
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except (ImportError, ValueError):
        pytest.skip("this torch has no FSDP2")
    example = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "train_fsdp2.py")
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    refused = subprocess.run([sys.executable, example, "--steps", "2"], capture_output=True, text=True, env=env,
                             timeout=300)
    assert refused.returncode == 2 and "need --checkpoint" in refused.stderr, refused.stderr
    odd = subprocess.run([sys.executable, example, "--layout", "fsdp-tp", "--checkpoint", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert odd.returncode == 2 and "needs an even number of ranks (a dp x 2 mesh), not 1" in odd.stderr, odd.stderr
    out = subprocess.run([sys.executable, example, "--steps", "3", "--checkpoint", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(re.findall(r"loss (\d+\.\d+)", out.stdout)) == 3 and "parameters equal" in out.stdout, out.stdout
