"""The benchmarked model: a preset's manifest (from the `normuon` tool) and seeded parameters with
gradients, set once and reused by every step."""
import csv
import io
import math
import re
import subprocess
from dataclasses import dataclass

import torch

import normuon

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class ManifestError(ValueError):
    """The tool could not give a preset's manifest (unknown preset, tool missing or failing)."""


@dataclass(frozen=True)
class Spec:
    name: str
    shape: tuple
    dtype: str       # the manifest's model dtype: f32 | bf16 | f16
    role: str        # matrix | embedding | head | norm | bias | other | router | experts
    algorithm: str   # normuon | adamw, by the project's routing rule (spec section 2)

    @property
    def numel(self):
        return math.prod(self.shape)


def _tool(cli, *args):
    try:
        done = subprocess.run([cli, *args], capture_output=True, text=True, timeout=120)
    except OSError as error:
        raise ManifestError(f"cannot run the normuon tool {cli!r} ({error}); pass --cli or set NORMUON_CLI") from None
    if done.returncode != 0:
        raise ManifestError((done.stderr or done.stdout).strip() or f"{cli} {' '.join(args)}: exit {done.returncode}")
    return done.stdout


def load_manifest(cli, preset):
    """The preset's parameters in manifest order, routed with normuon.route (the optimizer's own rule)."""
    specs = []
    for row in csv.DictReader(io.StringIO(_tool(cli, "manifest", "--preset", preset))):
        shape = tuple(int(x) for x in row["shape"].split("x")) if row["shape"] else ()
        override = row.get("algorithm") or None
        algorithm, _ = normuon.route(row["name"], shape, row["role"], None if override == "auto" else override)
        specs.append(Spec(row["name"], shape, row["dtype"], row["role"], algorithm))
    if not specs:
        raise ManifestError(f"normuon manifest --preset {preset}: no parameters")
    return specs


def bank_specs(specs):
    """The preset with its experts ("...experts.K.NAME.weight", one 2-D matrix each) stacked into banks
    "...experts.NAME" [E, m, n] (role experts), where the first expert stood, as transformers 5.x stores them."""
    out, banks = [], {}
    for s in specs:
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(.+)\.weight", s.name)
        if m is None:
            out.append(s)
            continue
        name = f"{m[1]}.{m[3]}"
        if name not in banks:
            banks[name] = []
            out.append(name)
        bank = banks[name]
        if int(m[2]) != len(bank) or (bank and s.shape != bank[0].shape):
            raise ManifestError(f"{s.name}: the experts of bank {name} are not numbered 0, 1, ... with one shape")
        bank.append(s)
    if not banks:
        raise ManifestError("--banks: the preset has no experts ('...experts.K.NAME.weight')")
    stacked = []
    for s in out:
        if isinstance(s, str):
            first = banks[s][0]
            shape = (len(banks[s]), *first.shape)
            s = Spec(s, shape, first.dtype, "experts", normuon.route(s, shape, "experts")[0])
        stacked.append(s)
    return stacked


class Model:
    """The parameters (nn.Parameter, manifest order) with .grad set once. Values come from one seeded
    generator, so every peer gets the same model: N(0, 0.02) parameters and N(0, 1) gradients (finite,
    never zero), rounded to the model dtype. `storage` keeps those values in another dtype (a peer that
    only takes fp32). `keep_pristine` keeps a copy of the gradients for peers that overwrite p.grad."""

    def __init__(self, specs, device, dtype_of, seed, storage=None, keep_pristine=False):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.specs = specs
        self.params = []
        for s in specs:
            model_dtype = dtype_of(s)
            dtype = storage or model_dtype
            value = torch.randn(s.shape, generator=gen, device=device).mul_(0.02).to(model_dtype).to(dtype)
            grad = torch.randn(s.shape, generator=gen, device=device).to(model_dtype).to(dtype)
            p = torch.nn.Parameter(value)
            p.grad = grad
            self.params.append(p)
        self._pristine = [p.grad.clone() for p in self.params] if keep_pristine else None

    def named(self):
        return [(s.name, p) for s, p in zip(self.specs, self.params)]

    def matrices(self):
        return [p for s, p in zip(self.specs, self.params) if s.algorithm == "normuon"]

    def others(self):
        return [p for s, p in zip(self.specs, self.params) if s.algorithm == "adamw"]

    def restore_grads(self):
        for p, g in zip(self.params, self._pristine):
            p.grad.copy_(g)
