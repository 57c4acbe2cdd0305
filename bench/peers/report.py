"""The results: one Row per peer (and variant) per preset, as a text table, markdown and CSV."""
import csv
import io
from dataclasses import dataclass, field

from .counts import KEYS as COUNT_KEYS

COUNT_HEADS = ("kernels", "memcpy", "memset", "D2H", "launch API", "syncs", "aten top", "aten all")

DEFINITIONS = """\
* **step ms**: median [min - max] over the measured steps, after the warm-up steps. CUDA: CUDA events
  recorded on the current stream right before and after `opt.step()`, with the device idle before the step
  and synchronised after it, so host overhead and any wait inside the step are included (the wall clock of
  the same span is in the CSV as wall_ms). CPU: `time.perf_counter` around `opt.step()`. fused-cpp comes
  from the tool's own measurement: on CUDA `fused-cpp` = eager steps back to back between two CUDA events
  (no wait per step), `fused-cpp (wait)` = one step at a time, the sum of its phase times (CUDA events
  between the phases), `fused-cpp (graph)` = CUDA-graph replays back to back; on the CPU the fast
  backend's whole step (wall clock) in `normuon bench`.
* **x official**, **x reference**: official's (reference's) median step time / this row's.
* Counts are per step, from `torch.profiler` (CPU + CUDA activities) over the profiled steps, each
  `opt.step()` inside a `record_function` range:
  * **kernels**, **memcpy**, **memset**: device activities CUPTI reports during the session (any library
    in the process: torch, cuBLAS/cuBLASLt, this project's backend); **D2H**: the memcpy that went
    device-to-host. Kernels of a CUDA graph count one by one.
  * **launch API**: host calls inside the step ranges of cudaLaunchKernel, cudaLaunchKernelExC,
    cudaLaunchCooperativeKernel, cuLaunchKernel(Ex), cudaGraphLaunch, cuGraphLaunch, as the profiler
    reports them (fewer than kernels: some launches went through a call it does not report, or one call
    ran several kernels).
  * **syncs**: host calls inside the step ranges that wait for the device: cudaStreamSynchronize,
    cudaDeviceSynchronize, cudaEventSynchronize (and their driver forms) and synchronous cudaMemcpy. A
    `.item()`/`.tolist()`/`torch.equal` is a cudaMemcpyAsync device-to-host followed by a
    cudaStreamSynchronize: it counts once here, and its copy once under D2H. A cudaMemcpyAsync into
    pageable host memory with no sync after it also blocks the host; it shows under D2H only.
  * **aten top**: ATen ops called from Python (aten:: events not nested in another aten:: event);
    **aten all**: every aten:: event, nested ones included (what the dispatcher ran; torch's own tables
    fold an op into a parent of the same name, this count does not).
  * fused-cpp: the backend's own counts, not the profiler's (eager: launch API = launches_per_step,
    its kernels and cuBLASLt matmuls, plus 1 cudaMemsetAsync not in the column; graph: 1 launch, kernels
    = kernel nodes of the captured graph).
* **extra MiB**: memory the optimizer adds beyond the model's parameters and gradients (which exist
  before it is built), from before its construction to after the measured steps. CUDA: extra =
  torch_peak + outside, torch_peak = max_memory_allocated - memory_allocated at the start (torch's
  allocator, peak), outside = (free memory at the start - free memory at the end, cudaMemGetInfo) -
  (growth of torch's reserved memory), i.e. device memory taken outside torch's allocator (the fast
  CUDA backend's cudaMalloc buffers, cuBLASLt workspaces, lazily loaded kernels), held at the end. Host
  memory (the fast backend's host staging copy) is not counted. CPU: growth of the resident set size
  (held, not peak; a rough number). fused-cpp runs in another process: n/a."""


@dataclass
class Row:
    preset: str
    peer: str
    variant: str = ""
    status: str = "ok"          # ok | skipped | failed
    reason: str = ""
    param_dtype: str = ""
    warmup: int = 0
    steps: int = 0
    step_ms: object = None      # measure.Series
    wall_ms: object = None
    counts: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    vs_official: float = None
    vs_reference: float = None

    @property
    def label(self):
        return f"{self.peer} ({self.variant})" if self.variant else self.peer


def add_speedups(rows):
    """x official and x reference of every row with a time, per preset."""
    for preset in {r.preset for r in rows}:
        base = {r.peer: r.step_ms.median for r in rows
                if r.preset == preset and r.status == "ok" and r.step_ms and not r.variant}
        for r in rows:
            if r.preset == preset and r.status == "ok" and r.step_ms:
                r.vs_official = base["official"] / r.step_ms.median if "official" in base else None
                r.vs_reference = base["reference"] / r.step_ms.median if "reference" in base else None


def _num(x, digits=1):
    if x is None:
        return "-"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.{digits}f}"


def _cells(r):
    time = (f"{r.step_ms.median:.3f} [{r.step_ms.min:.3f} - {r.step_ms.max:.3f}]" if r.step_ms
            else r.status)
    speed = [f"{x:.2f}x" if x else "-" for x in (r.vs_official, r.vs_reference)]
    counts = [_num(r.counts.get(k)) for k in COUNT_KEYS]
    return [r.label, r.param_dtype, time, *speed, *counts, _num(r.memory.get("extra_mib"))]


HEADS = ["peer", "dtype", "step ms median [min - max]", "x official", "x reference", *COUNT_HEADS, "extra MiB"]


def _notes(rows):
    """(row label, text) for every row with a reason or notes."""
    out = []
    for r in rows:
        parts = ([f"{r.status.upper()}: {r.reason}"] if r.status != "ok" else []) + list(r.notes)
        if parts:
            out.append((r.label, "; ".join(parts)))
    return out


def _table_lines(rows):
    cells = [HEADS] + [_cells(r) for r in rows]
    widths = [max(len(c[j]) for c in cells) for j in range(len(HEADS))]
    lines = []
    for i, c in enumerate(cells):
        lines.append("  ".join(x.ljust(w) if j < 3 else x.rjust(w) for j, (x, w) in enumerate(zip(c, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def text_report(rows, presets, title, width=400):
    """The console form, kept short (a remote run may return only the last 12,000 characters): a table per
    preset with the reasons of skipped or failed rows below it (cut at `width`), then every distinct note
    once."""
    lines = [title]
    for preset in presets:
        mine = [r for r in rows if r.preset == preset]
        lines += ["", f"== {preset}"] + _table_lines(mine)
        for r in mine:
            if r.status != "ok":
                why = r.reason if len(r.reason) <= width else r.reason[:width - 3] + "..."
                lines.append(f"  {r.label}: {r.status.upper()}: {why}")
    seen = []
    for r in rows:
        for note in r.notes:
            if (r.label, note) not in seen:
                seen.append((r.label, note))
    if seen:
        lines += ["", "notes:"] + [f"  {label}: {note}" for label, note in seen]
    return "\n".join(lines)


def markdown_table(rows):
    lines = ["| " + " | ".join(HEADS) + " |", "|" + "---|" * len(HEADS)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in _cells(r)) + " |" for r in rows]
    notes = _notes(rows)
    if notes:
        lines += [""] + [f"* **{label}**: {text}" for label, text in notes]
    return "\n".join(lines)


CSV_FIELDS = ["preset", "device", "torch", "param_dtype", "peer", "variant", "status", "reason", "warmup", "steps",
              "step_ms_median", "step_ms_min", "step_ms_max", "wall_ms_median", "wall_ms_min", "wall_ms_max",
              "speedup_vs_official", "speedup_vs_reference", *[f"{k}_per_step" for k in COUNT_KEYS],
              "torch_peak_mib", "outside_torch_mib", "extra_mib", "notes"]


def csv_text(rows, device, torch_version):
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_FIELDS)
    for r in rows:
        times = [getattr(s, k) if s else None for s in (r.step_ms, r.wall_ms) for k in ("median", "min", "max")]
        counts = [r.counts.get(k) for k in COUNT_KEYS]
        mem = [r.memory.get(k) for k in ("torch_peak_mib", "outside_mib", "extra_mib")]
        numbers = ["" if x is None else f"{x:.6g}" for x in [*times, r.vs_official, r.vs_reference, *counts, *mem]]
        w.writerow([r.preset, device, torch_version, r.param_dtype, r.peer, r.variant, r.status, r.reason, r.warmup,
                    r.steps, *numbers, "; ".join(r.notes)])
    return buf.getvalue()
