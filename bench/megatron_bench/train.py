"""Bench's training: the fixed token batches and one iteration as megatron.training's train_step runs it."""
import functools
import time

from .plan import OPTIMIZER_TIMERS


class Train:
    """A mixin of Bench (self.args, self.torch, self.m: Megatron's classes, self.device)."""

    def make_batches(self):
        """The same fixed token batches for every run: [iters] of (tokens, labels, loss_mask, position_ids)."""
        torch, a = self.torch, self.args
        g = torch.Generator().manual_seed(a.seed + 1)
        n, b, s, v = a.iters, a.micro_batch_size, a.seq_length, a.vocab_size
        if a.data == "uniform":
            seq = torch.randint(0, v, (n, b, s + 1), generator=g)
        else:
            nxt = torch.randperm(v, generator=g)
            seq = torch.empty((n, b, s + 1), dtype=torch.long)
            seq[:, :, 0] = torch.randint(0, v, (n, b), generator=g)
            follow = torch.rand((n, b, s), generator=g) < 0.9
            noise = torch.randint(0, v, (n, b, s), generator=g)
            for t in range(s):
                seq[:, :, t + 1] = torch.where(follow[:, :, t], nxt[seq[:, :, t]], noise[:, :, t])
        self.batches = []
        for i in range(n):
            tokens = seq[i, :, :-1].contiguous()
            labels = seq[i, :, 1:].contiguous()
            self.batches.append(dict(tokens=tokens, labels=labels, loss_mask=torch.ones((b, s), dtype=torch.float),
                                     position_ids=torch.arange(s).unsqueeze(0).expand(b, s).contiguous()))

    # ------------------------------------------------------------------ one iteration

    def forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        dev = self.device
        tokens, labels = batch["tokens"].to(dev), batch["labels"].to(dev)
        position_ids, loss_mask = batch["position_ids"].to(dev), batch["loss_mask"].to(dev)
        output = model(tokens, position_ids, None, labels=labels)
        return output, functools.partial(self.loss_func, loss_mask)

    @staticmethod
    def loss_func(loss_mask, output_tensor):
        """pretrain_gpt.py's loss_func: the sum of per-token losses, the token count, and the report."""
        import torch

        losses = output_tensor.view(-1).float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * loss_mask)
        num_tokens = loss_mask.sum().clone().detach().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}

    def train_iteration(self, b, it):
        """megatron.training.training.train_step for one microbatch: zero_grad_buffer, zero_grad, Megatron's
        forward-backward schedule (finalize_model_grads inside), optimizer.step() inside the 'optimizer' timer,
        the scheduler step."""
        torch, a = self.torch, self.args
        model, optimizer, timers = b["model"], b["optimizer"], b["timers"]
        model.zero_grad_buffer()
        optimizer.zero_grad()
        fb = self.m["get_forward_backward_func"]()
        losses_reduced = fb(forward_step_func=self.forward_step, data_iterator=iter([self.batches[it - 1]]),
                            model=[model], num_microbatches=1, seq_length=a.seq_length,
                            micro_batch_size=a.micro_batch_size, decoder_seq_length=a.seq_length, forward_only=False)
        cuda = a.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        timers("optimizer", log_level=1).start(barrier=False)
        t0 = time.perf_counter()
        if cuda:
            ev0.record()
        update_successful, grad_norm, num_zeros = optimizer.step()
        if cuda:
            ev1.record()
            torch.cuda.synchronize()
        wall_ms = 1000.0 * (time.perf_counter() - t0)
        timers("optimizer").stop()
        event_ms = ev0.elapsed_time(ev1) if cuda else None
        lr = [float(g["lr"]) for g in optimizer.param_groups]
        if update_successful:
            b["scheduler"].step(increment=a.micro_batch_size)  # global batch = micro batch (1 microbatch, DP 1)
        timer_ms = {}
        for name in OPTIMIZER_TIMERS:
            t = timers._timers.get(name)  # only the ones Megatron created; creating one here could clash levels
            if t is not None:
                timer_ms[name] = 1000.0 * t.elapsed(reset=True)
        report = losses_reduced[0]["lm loss"].view(-1)
        loss = (report[0] / report[1]).item()
        return dict(iteration=it, loss=loss, loss_hex=float(loss).hex(), grad_norm=None if grad_norm is None
                    else float(grad_norm), update_successful=bool(update_successful), lr=lr[0] if lr else None,
                    lr_groups=sorted(set(lr)), step_wall_ms=wall_ms, step_event_ms=event_ms, timers_ms=timer_ms)
