"""The Python optimizer and the `normuon` tool share manifests and state files: a file saved from Python
loads in the tool and vice versa, and both continue a run to the same bits."""
import os
import subprocess

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")

import normuon  # noqa: E402
from conftest import cli_path, make_model, require_native  # noqa: E402


def cli(*args):
    env = {k: v for k, v in os.environ.items() if k != "NORMUON_BACKEND"}
    done = subprocess.run([cli_path(), *map(str, args)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, f"normuon {' '.join(map(str, args))} failed:\n{done.stdout}{done.stderr}"
    return done.stdout


def generator_grads(opt, generator, step):
    """The CLI's deterministic gradients for `step` (GradientGenerator, by layout entry) on the model."""
    flat = normuon._C.FlatState(opt.layout)
    generator.fill_gradients(flat, step)
    grads = torch.from_numpy(flat.grads)
    tensors = {n: p for g in opt.param_groups for n, p in zip(g["param_names"], g["params"])}
    for i, entry in enumerate(opt.layout.entries):
        tensor = tensors[entry.name]
        span = grads[entry.offset:entry.offset + entry.numel]
        tensor.grad = span.view(tensor.shape).clone() if flat.has_grad[i] else None


def checksums(path):
    header = normuon._C.read_state_header(str(path))
    return {t["name"]: t["crc32"] for t in header["tensors"]}, header["group_steps"]


def test_manifest_and_layout_agree_with_the_tool(tmp_path):
    require_native()
    opt = normuon.NorMuonAdamW(make_model().named_parameters())
    opt.write_manifest(tmp_path / "model.csv")
    out = cli("layout", "--manifest", tmp_path / "model.csv")
    assert f"layout {opt.layout.fingerprint}" in out
    assert "blocks.0.attn.weight [96x32] group=normuon" in out


def test_state_files_cross_between_python_and_the_tool(tmp_path):
    require_native()
    model = make_model()
    opt = normuon.NorMuonAdamW(model.named_parameters(), backend="fast")
    opt.write_manifest(tmp_path / "model.csv")
    manifest = tmp_path / "model.csv"
    # The tool makes a state (3 steps, one parameter in 3 missing its gradient now and then) ...
    cli("run", "--manifest", manifest, "--steps", 3, "--missing-grad-period", 3, "--backend", "fast", "--quiet",
        "--save", tmp_path / "cli3.safetensors")
    # ... Python resumes it for 2 steps with the same generated gradients ...
    opt.import_state(tmp_path / "cli3.safetensors")
    assert [g["step"] for g in opt.param_groups] == [3, 3]
    generator = normuon._C.GradientGenerator(1234, 3)
    for step in (4, 5):
        generator_grads(opt, generator, step)
        opt.step()
    opt.export_state(tmp_path / "py5.safetensors")
    # ... and so does the tool: the two files hold the same bits.
    cli("run", "--manifest", manifest, "--load", tmp_path / "cli3.safetensors", "--steps", 2,
        "--missing-grad-period", 3, "--backend", "fast", "--quiet", "--save", tmp_path / "cli5.safetensors")
    py_sums, py_steps = checksums(tmp_path / "py5.safetensors")
    cli_sums, cli_steps = checksums(tmp_path / "cli5.safetensors")
    assert py_steps == cli_steps == [5, 5]
    assert py_sums == cli_sums
    # The tool reads the Python file (checksums verified) and resumes from it.
    out = cli("inspect", tmp_path / "py5.safetensors")
    assert "(checksums verified)" in out and "backend:  fast-cpu" in out
    assert "group:    normuon at step 5" in out and f"layout:   {opt.layout.fingerprint}" in out
    assert "resumed from" in cli("run", "--manifest", manifest, "--load", tmp_path / "py5.safetensors",
                                 "--steps", 1, "--quiet")
