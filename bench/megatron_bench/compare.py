"""Bench's bit-for-bit checks: snapshots of the model and optimizer state, and losses, compared."""


class Compare:
    """A mixin of Bench (self.torch, self.leaves)."""

    def snapshot(self, b):
        """CPU copies of every model parameter, every main parameter the torch optimizers hold, every tensor
        of their state, and the group step counters."""
        torch = self.torch
        snap = {}
        for name, p in b["model"].named_parameters():
            snap[f"model/{name}"] = p.detach().to("cpu", copy=True)
        for i, leaf in enumerate(self.leaves(b["optimizer"])):
            inner = getattr(leaf, "optimizer", None)
            if inner is None:
                continue
            label = f"opt{i}:{type(inner).__name__}"
            for gi, g in enumerate(inner.param_groups):
                if "step" in g:
                    step = g["step"]
                    snap[f"{label}/g{gi}/step"] = torch.tensor(float(step.item() if torch.is_tensor(step) else step))
                for pi, p in enumerate(g["params"]):
                    key = f"{label}/g{gi}/p{pi}"
                    snap[f"{key}/main_param"] = p.detach().to("cpu", copy=True)
                    for k, v in (inner.state.get(p) or {}).items():
                        if torch.is_tensor(v):
                            snap[f"{key}/{k}"] = v.detach().to("cpu", copy=True)
                        elif isinstance(v, (int, float)):
                            snap[f"{key}/{k}"] = torch.tensor(float(v))
        return snap

    def compare(self, a_snap, b_snap):
        torch = self.torch
        keys = sorted(set(a_snap) | set(b_snap))
        missing = [k for k in keys if k not in a_snap or k not in b_snap]
        diffs, n_bad, worst = {}, 0, (0.0, None)
        for k in keys:
            if k in missing:
                continue
            x, y = a_snap[k], b_snap[k]
            if x.shape != y.shape or x.dtype != y.dtype:
                n_bad += 1
                diffs[k] = f"shape/dtype {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"
                continue
            same = x.numel() == 0 or bool((x.reshape(-1).view(torch.uint8) == y.reshape(-1).view(torch.uint8)).all())
            if not same:
                n_bad += 1
                d = float((x.double() - y.double()).abs().max())
                diffs[k] = d
                if not worst[1] or d > worst[0]:
                    worst = (d, k)
        return {"bitwise_equal": n_bad == 0 and not missing, "tensors": len(keys), "mismatched": n_bad,
                "missing": missing[:10], "max_abs_diff": worst[0] if worst[1] else 0.0, "worst": worst[1],
                "first_mismatches": dict(list(diffs.items())[:8])}

    @staticmethod
    def compare_losses(ref, got):
        pairs = [(r, g) for r in ref for g in got if r["iteration"] == g["iteration"]]
        bad = [(r["iteration"], r["loss"], g["loss"]) for r, g in pairs
               if r["loss_hex"] != g["loss_hex"] or (r["grad_norm"] != g["grad_norm"])]
        return {"iterations": [r["iteration"] for r, _ in pairs], "bitwise_equal": not bad and bool(pairs),
                "max_abs_diff": max((abs(x - y) for _, x, y in bad), default=0.0), "first_mismatch": bad[:3]}
