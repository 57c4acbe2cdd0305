"""bench/python_step.py end to end on the tiny preset: every contender timed, the report written."""
import csv
import os
import sys

import pytest

pytest.importorskip("torch")
from conftest import require_native  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))


def test_tiny_run_writes_both_reports(tmp_path):
    require_native()
    import python_step

    python_step.main(["--preset", "tiny", "--warmup", "1", "--repeats", "1", "--threads", "1", "--out", str(tmp_path)])
    with open(tmp_path / "python-step-tiny.csv") as f:
        rows = {r["contender"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"python", "cpp", "reference", "adamw"}
    assert int(rows["cpp"]["ops"]) == 0  # the native call dispatches no torch operator
    assert int(rows["reference"]["ops"]) == int(rows["python"]["ops"])  # one native call too, whatever the backend
    assert "Python step vs C++ step" in (tmp_path / "python-step-tiny.md").read_text()
    assert not list(tmp_path.glob("*.tmp"))


def test_gradients_of_a_bf16_preset_take_its_dtype():
    """moe-8x64 is bf16: its gradients are made in the parameters' dtype (torch 2.x refuses an fp32
    gradient on a bf16 parameter, which stopped the bench on its first step)."""
    require_native()
    import python_step
    import torch

    model = torch.nn.Linear(4, 3, bias=False).to(torch.bfloat16)
    python_step.fill_grads(model, 1)
    assert model.weight.grad.dtype == torch.bfloat16
    python_step.fill_grads(model, 2)  # into the same tensor
    assert model.weight.grad.dtype == torch.bfloat16
