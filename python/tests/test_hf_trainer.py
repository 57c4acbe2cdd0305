"""The Hugging Face Trainer with NorMuonAdamW: normuon.hf.trainer_optimizer routes by the model's modules and keeps
the Trainer's weight decay (its decay / no-decay rule, args.weight_decay on both algorithms); optimizers=(opt, None)
works too. A real Trainer trains a tiny Mixtral built from its config (nothing is downloaded)."""
import warnings

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (scripts/setup.sh puts it "
                                                          "in the torch 2.x environment)")
pytest.importorskip("accelerate", reason="accelerate (the Trainer's) is not installed: scripts/setup.sh")

import normuon  # noqa: E402
import normuon.hf  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=8, length=8):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_mixtral():
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


def training_args(tmp_path, **kw):
    return transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                                          learning_rate=1e-3, weight_decay=0.1, report_to=[], save_strategy="no",
                                          logging_strategy="no", use_cpu=True, **kw)


def test_trainer_optimizer_routes_by_the_model_and_keeps_weight_decay(tmp_path, native):
    model = tiny_mixtral()
    args = training_args(tmp_path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no routing doubt: the model's modules told every role
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                       optimizer_cls_and_kwargs=normuon.hf.trainer_optimizer(args, lr=0.02,
                                                                                             threads=1))
        trainer.train()
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(opt, normuon.NorMuonAdamW)
    rows = {r["name"]: r for r in opt.routing_table()}
    assert rows["model.embed_tokens.weight"]["algorithm"] == "adamw"
    assert rows["lm_head.weight"]["role"] == "head" and rows["lm_head.weight"]["algorithm"] == "adamw"
    assert rows["model.layers.0.mlp.gate.weight"]["role"] == "router"
    assert rows["model.layers.0.mlp.experts.down_proj"]["algorithm"] == "normuon"
    groups = {g["name"]: g for g in opt.param_groups}
    # The Trainer's rule: norms (and biases) do not decay; everything else decays by args.weight_decay.
    assert groups["decay_normuon"]["weight_decay"] == 0.1 and groups["decay_adamw"]["weight_decay"] == 0.1
    assert groups["no_decay_adamw"]["weight_decay"] == 0.0
    assert "model.norm.weight" in groups["no_decay_adamw"]["param_names"]
    assert "lm_head.weight" in groups["decay_adamw"]["param_names"]
    # The Trainer's schedule scales each group from its own lr: NorMuon's as given, AdamW's args.learning_rate.
    assert groups["decay_normuon"]["initial_lr"] == 0.02 and groups["decay_adamw"]["initial_lr"] == 1e-3
    assert groups["decay_adamw"]["step"] == 2
    assert any(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters())


def test_weight_decay_comes_from_the_trainer_alone(tmp_path):
    args = training_args(tmp_path)
    with pytest.raises(TypeError, match="takes no weight_decay=: the Trainer's args.weight_decay"):
        normuon.hf.trainer_optimizer(args, weight_decay=0.5)


def test_an_optimizer_handed_over_works_too(tmp_path, native):
    model = tiny_mixtral()
    opt = normuon.NorMuonAdamW(model, threads=1, adamw_weight_decay=0.1)
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path), train_dataset=Tokens(),
                                   optimizers=(opt, None))
    trainer.train()
    assert opt.param_groups[0]["step"] == 2


def test_gpt2_through_the_trainer_steps_its_conv1d_weights_as_their_module(tmp_path, native):
    """GPT-2's Conv1D weights ([in, out]) reach the optimizer through the Trainer's groups: the model tells them."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2,
                                                                 n_head=2))
    args = training_args(tmp_path)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   optimizer_cls_and_kwargs=normuon.hf.trainer_optimizer(args, lr=0.02, threads=1))
    trainer.train()
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    rows = {r["name"]: r for r in opt.routing_table()}
    conv = [n for n in rows if n.endswith(("c_attn.weight", "c_fc.weight", "c_proj.weight"))]
    assert len(conv) == 8 and all(rows[n]["transposed"] and rows[n]["stats"] == "cols" for n in conv)
    assert {g["name"] for g in opt.param_groups if g.get("transposed")} == {"decay_normuon"}
