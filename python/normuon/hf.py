"""NorMuonAdamW for the Hugging Face Trainer (docs/python.md, "The Hugging Face Trainer").

    trainer = Trainer(model, args, optimizer_cls_and_kwargs=normuon.hf.trainer_optimizer(args, lr=0.02))

The Trainer hands an optimizer class its decay / no-decay groups of unnamed tensors, so the embeddings and the
head could not be told from hidden matrices; and an optimizer given the model instead gets no groups, so
args.weight_decay would be lost. A factory (transformers 5.x calls one with the model, as for its own Muon and
Dion) gets both: the model's modules route every parameter, and the Trainer's own rule
(Trainer.get_decay_parameter_names) says which parameters decay, by args.weight_decay, on either algorithm.
"""
from .optim import NorMuonAdamW


def trainer_optimizer(args, **knobs):
    """(factory, kwargs) for Trainer(optimizer_cls_and_kwargs=...). args: the TrainingArguments (their
    weight_decay, and learning_rate as AdamW's lr unless adamw_lr= is given); knobs: NorMuonAdamW's keywords
    (lr= is NorMuon's). Needs transformers 5.x, whose Trainer builds optimizer factories."""
    given = sorted({"weight_decay", "adamw_weight_decay"} & set(knobs))
    if given:
        raise TypeError(f"trainer_optimizer takes no {' or '.join(given)}=: the Trainer's args.weight_decay decays "
                        "both algorithms' parameters that its rule decays, and nothing else")
    kwargs = dict(knobs, weight_decay=args.weight_decay)
    kwargs.setdefault("adamw_lr", args.learning_rate)
    return _TrainerFactory, kwargs


class _TrainerFactory:
    """What the Trainer calls: _TrainerFactory()(model, **kwargs) builds the optimizer."""

    def __call__(self, model, weight_decay, **knobs):
        from transformers import Trainer  # the Trainer's rule, not a copy of it (it reads no Trainer state)

        decay = set(Trainer.get_decay_parameter_names(None, model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [dict(name=name, params=params, weight_decay=wd, adamw_weight_decay=wd)
                  for name, params, wd in (("decay", [x for x in named if x[0] in decay], weight_decay),
                                           ("no_decay", [x for x in named if x[0] not in decay], 0.0))
                  if params]
        return NorMuonAdamW(groups, model=model, **knobs)
