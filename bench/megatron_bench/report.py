"""The report (compact text last on stdout, Markdown for --markdown), the overall verdict, and writing the
outputs (atomically)."""
import json

from peers.files import write_atomic  # bench/ is sys.path[0]: bench/megatron_gpt.py runs as a script

from .helpers import fmt
from .plan import MODES, OPTIMIZER_TIMERS


class Report:
    """The report of a set of runs (the results dict this script writes as JSON); needs neither torch nor
    Megatron, so the parent process of --isolate can write it even when every child died."""

    def __init__(self, results, args):
        self.results, self.args = results, args

    SHORT = {"adam": "adam", "normuon": "nm", "normuon-stock": "nm-stock", "normuon-nosplit": "nm-nosplit",
             "adamw": "nm-adamw", "mcore-normuon": "mc-normuon"}

    def short_label(self, r):
        backend = r.get("backend")
        return (self.SHORT.get(r["variant"], r["variant"]) + (f"@{backend[:3]}" if backend else "")
                + (MODES[r["mode"]][1] if r.get("mode", "off") != "off" else ""))

    @staticmethod
    def short_tree(text):
        for long, short in (("Float16OptimizerWithFloat16Params", "F16"), ("LayerWiseDistributedOptimizer", "LayerWise"),
                            ("DistributedOptimizer", "DistOpt"), ("ChainedOptimizer", "Chain"),
                            ("normuon.megatron.", ""), ("torch.optim.adamw.AdamW", "torch.AdamW"),
                            ("megatron.core.optimizer.emerging_optimizers.", "mcore.")):
            text = text.replace(long, short)
        return text

    def report_text(self, markdown=False):
        """The report: Markdown for --markdown, else the compact text printed last on stdout (only the last 12,000
        characters of a remote run's output may come back, so it abbreviates)."""
        env, runs, a = self.results.get("setup", {}), self.results["runs"], self.args
        compact = not markdown
        bullet = "* " if markdown else ""
        lines = []
        h = (lambda s: f"\n## {s}\n") if markdown else (lambda s: f"--- {s}")
        lines.append("# Megatron-LM GPT run: normuon vs Megatron's Adam" if markdown else
                     "=================== REPORT: bench/megatron_gpt.py ===================")
        for k in ("date", "device", "gpu", "gpu_memory_gib", "cuda", "nccl", "torch", "python", "megatron_core",
                  "megatron_source", "emerging_optimizers", "normuon_path", "process_group_backend", "host", "command",
                  "note"):
            if env.get(k) is not None:
                value = f"`{env[k]}`" if markdown and k == "command" else env[k]
                lines.append(f"{bullet}{k}: {value}")
        lines.append(f"{bullet}model: GPTModel, local spec, {a.num_layers} layers, hidden "
                     f"{a.hidden_size}, {a.num_attention_heads} heads / {a.num_query_groups} query groups, ffn "
                     f"{a.ffn_hidden_size}, vocab {a.vocab_size}, seq {a.seq_length}, micro batch "
                     f"{a.micro_batch_size}, bf16 params, fp32 grads (grad_reduce_in_fp32), rope, dropout 0; data {a.data}; "
                     f"lr {a.lr:g} ({a.lr_decay_style}, warmup {a.lr_warmup_iters} from 0, min {a.min_lr:g}), "
                     f"wd {a.weight_decay:g}, clip {a.clip_grad:g}" + (f"; --set {a.config_set}" if a.config_set else ""))
        if env.get("megatron_fallback_warnings") and not compact:
            lines.append(f"{bullet}Megatron at import: " + " | ".join(env["megatron_fallback_warnings"]))
        labels = [self.short_label(r) if compact else r["label"] for r in runs]
        if compact:
            short = {"distopt": "DistributedOptimizer", "layerwise": "LayerWise, ping-pong path",
                     "layerwise-layout": "LayerWise + DistributedOptimizer over DDP's layer-wise layout"}
            used = sorted({r.get("mode", "off") for r in runs} - {"off"})
            lines.append("runs: nm = normuon, @ref = @reference" + "".join(f", {MODES[m][1]} = {short[m]}" for m in used)
                         + " (full names in --json/--markdown)")

        lines.append(h("optimizers Megatron built"))
        for r, label in zip(runs, labels):
            built = r.get("built")
            if not built:
                lines.append(f"{bullet}{label}: not built")
                continue
            backends = sorted({leaf["backend"] for leaf in built["leaves"] if "backend" in leaf})
            splits = sorted({str(leaf["split_qkv"]) for leaf in built["leaves"] if "split_qkv" in leaf})
            extra = ""
            if backends:
                extra += f"; normuon backend {'/'.join(backends)}"
            if splits:
                extra += f"; split_qkv {'/'.join(splits)}"
            if "routing_check" in built:
                rc = built["routing_check"]
                extra += (f"; its {rc['muon_params']} matrices {'==' if rc['agree'] else 'DIFFER FROM'} Megatron's "
                          f"is_managed_by_layer_wise_optimizer ({rc['layer_wise_predicate']})")
            tree = self.short_tree(built["tree"]) if compact else built["tree"]
            lines.append(f"{bullet}{label}: {tree}{extra}")
            if not compact:
                lines.append("    holding: " + " + ".join(
                    f"{leaf['wrapper'].rsplit('.', 1)[-1]}({leaf['optimizer']}: {leaf['tensors']} tensors, "
                    f"{leaf['elements']} elements)" for leaf in built["leaves"]))
        qkv = next((r["built"]["qkv"] for r in runs if r.get("built", {}).get("qkv")), None)
        if qkv:
            lines.append(f"{bullet}QKV: {qkv['params']} linear_qkv weights of shape {qkv['shape']}, "
                         f"qkv_split_shapes {qkv['qkv_split_shapes']} per query group")

        lines.append(h("loss per iteration (mean cross entropy over the batch's tokens; the same batches for every run)"))
        digits = ".4f" if compact else ".6f"
        lines += self.table(["iter"] + labels, [[str(it)] + [fmt(self.iter_value(r, it, "loss"), digits) for r in runs]
                                                 for it in range(1, a.iters + 1)], markdown)
        if markdown:
            lines.append(h("grad norm per iteration (Megatron's, before clipping)"))
            lines += self.table(["iter"] + labels, [[str(it)] + [fmt(self.iter_value(r, it, "grad_norm"), ".5f")
                                                                 for r in runs] for it in range(1, a.iters + 1)], markdown)
        else:
            lines.append("(grad norms, lr and every timer per iteration: --json / --markdown)")

        lines.append(h(f"optimizer.step() time (ms), median over iterations 2..{a.iters}"))
        names = [n for n in OPTIMIZER_TIMERS if n != "forward-backward"
                 and any(n in r.get("summary", {}).get("median_timer_ms", {}) for r in runs)]
        if compact:
            names = [n for n in names if n in ("optimizer", "optimizer-inner-step")]
        rows = []
        for r, label in zip(runs, labels):
            sm = r.get("summary", {})
            t = sm.get("median_timer_ms", {})
            rows.append([label, fmt(sm.get("median_step_event_ms"), ".3f"), fmt(sm.get("median_step_wall_ms"), ".3f")]
                        + [fmt(t.get(n), ".3f") for n in names] + [fmt(sm.get("first_step_ms"), ".1f")])
        lines += self.table(["run", "CUDA events", "wall"] + [f"timer {n}" for n in names] + ["first step"], rows,
                            markdown)
        lines.append("(CUDA events, wall: around optimizer.step(); timer X: Megatron's Timers ('optimizer' is train_step's, "
                     "around optimizer.step()); first step: iteration 1's wall time, normuon's layout build included)")

        if a.resume_at:
            lines.append(h(f"checkpoint resume (save after iteration {a.resume_at}, resume a fresh model and optimizer "
                           f"from it, run to {a.iters}, compare bit for bit with the uninterrupted run)"))
        else:
            lines.append(h("checkpoint resume: not tested (--resume-at 0)"))
        rows = []
        for r, label in zip(runs, labels):
            det = r.get("determinism")
            dtext = "-" if not det else ("bitwise" if det["losses"]["bitwise_equal"] and det["state"]["bitwise_equal"]
                                         else f"DIFFERS (max {det['state']['max_abs_diff']:.3g})")
            for f in a.formats if a.resume_at else []:
                x = r["resume"].get(f)
                if x is None:
                    rows.append([label, f, "not reached", "-", "-", "-", dtext])
                elif "error" in x:
                    what = "n/a (Megatron)" if x.get("megatron_limitation") else "ERROR"
                    text = "" if compact and x.get("megatron_limitation") else ": " + str(x["error"])[:40 if compact else 200]
                    rows.append([label, f, what + text, "-", "-", "-", dtext])
                elif "state" not in x:
                    rows.append([label, f, "not reached (error before the resume)", "-", "-", "-", dtext])
                else:
                    st, lo = x["state"], x["losses"]
                    worst = f" ({st['worst']})" if st["worst"] and not compact else ""
                    rows.append([label, f, "BITWISE EQUAL" if st["bitwise_equal"] and lo["bitwise_equal"] else "DIFFERS",
                                 f"{'equal' if lo['bitwise_equal'] else 'differ'}"
                                 + ("" if lo["bitwise_equal"] else f" (max {lo['max_abs_diff']:.3g})"),
                                 f"{st['tensors'] - st['mismatched']}/{st['tensors']}",
                                 f"{st['max_abs_diff']:.3g}{worst}", dtext])
        if rows:
            lines += self.table(["run", "format", "verdict", "losses, grad norms", "tensors equal", "max abs diff",
                                 "rerun from scratch"], rows, markdown)
            lines.append("(tensors: model parameters, main parameters, optimizer state, group steps; rerun from scratch: "
                         "a second uninterrupted run, to tell nondeterminism apart from resume errors)")

        errors = [(label, e) for r, label in zip(runs, labels) for e in r["errors"]]
        if errors:
            lines.append(h("errors"))
            reasons, same = {}, {}
            for label, e in errors:
                if e.get("megatron_limitation"):
                    reasons.setdefault(e["megatron_limitation"], []).append(f"{label} ({e['stage']})")
                    continue
                # the same error in several runs is printed once
                message = e["error"].split(": ", 1)[-1]
                same.setdefault(message, []).append((label, e))
            for message, where in same.items():
                e = where[0][1]
                runs_text = ", ".join(f"{label} ({x['stage']})" for label, x in where)
                lines.append(f"{bullet}{runs_text}: {message[:400 if compact else 1500]}")
                if e.get("hint"):
                    lines.append(f"    hint: {e['hint']}")
                tail = [x.strip()[:200] for x in e["traceback"].strip().splitlines() if x.strip()]
                tail = [x for x in tail if not x.startswith("^")][-(6 if compact else 14):]
                lines += ["    " + x for x in tail]
            for reason, where in reasons.items():
                lines.append(f"{bullet}n/a, Megatron's own limitation (not normuon's), in {', '.join(where)}: {reason}")
        ok = self.results.get("ok", False)
        lines.append("")
        lines.append("run status: " + ", ".join(f"{label} {r.get('status', '?')}" for r, label in zip(runs, labels)))
        lines.append(f"{'**' if markdown else ''}overall: {'PASS' if ok else 'FAIL'}{'**' if markdown else ''} "
                     f"({sum(r.get('status') == 'ok' for r in runs)}/{len(runs)} runs completed every iteration with "
                     "bit-exact resumes; Megatron's own limitations are n/a, not failures)")
        return "\n".join(lines) + "\n"

    @staticmethod
    def iter_value(r, it, key):
        for x in r["iterations"]:
            if x["iteration"] == it:
                return x[key]
        return None

    @staticmethod
    def table(header, rows, markdown):
        if markdown:
            out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
            out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
            return out
        widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
        out = ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(header, widths)))]
        out += ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
                for row in rows]
        return out


def overall_ok(runs):
    return bool(runs) and all(r.get("status") in ("ok", "n/a (Megatron)") for r in runs) and \
        any(r.get("status") == "ok" for r in runs)


def write_outputs(args, results, print_report):
    results["ok"] = overall_ok(results["runs"])
    if args.json:
        write_atomic(args.json, json.dumps(results, indent=1, default=str) + "\n")
    if args.markdown:
        write_atomic(args.markdown, Report(results, args).report_text(markdown=True))
    if print_report:
        print(Report(results, args).report_text(markdown=False), flush=True)
