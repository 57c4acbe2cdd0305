"""--pretrain-gpt: the command for the stock pretrain_gpt.py, through bench/megatron_pretrain_gpt.py."""
import os
import sys
import tempfile
import time

from .helpers import REPO, free_port


def pretrain_gpt_command(args):
    """The stock pretrain_gpt.py --mock-data with tiny sizes and normuon registered as 'adaptive_muon', through
    bench/megatron_pretrain_gpt.py. Returns (argv, env additions)."""
    mlm = os.path.abspath(args.megatron_path or os.path.join(REPO, ".megatron-lm"))
    save = os.path.join(tempfile.gettempdir(), "megatron_gpt_pretrain_" + time.strftime("%Y%m%d-%H%M%S"))
    argv = [sys.executable, os.path.join(REPO, "bench", "megatron_pretrain_gpt.py"), "--megatron-lm", mlm, "--",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(args.vocab_size),
            "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads), "--group-query-attention",
            "--num-query-groups", str(args.num_query_groups), "--ffn-hidden-size", str(args.ffn_hidden_size),
            "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
            "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(args.micro_batch_size),
            "--train-iters", str(args.iters), "--lr", str(args.lr), "--min-lr", str(args.min_lr),
            "--lr-decay-style", "cosine", "--lr-warmup-iters", str(args.lr_warmup_iters),
            "--weight-decay", str(args.weight_decay), "--clip-grad", str(args.clip_grad), "--bf16",
            "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
            "--attention-dropout", "0", "--hidden-dropout", "0", "--position-embedding-type", "rope",
            "--untie-embeddings-and-output-weights", "--optimizer", "adaptive_muon",
            "--muon-coefficient-type", "simple", "--muon-momentum", "0.95", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--adam-eps", "1e-8", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", str(10 * args.iters),
            "--save", save, "--save-interval", str(max(args.resume_at, 1)), "--ckpt-format", "torch_dist",
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--seed", str(args.seed),
            "--timing-log-level", "2"] + list(args.pretrain_arg)
    return argv, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                  "LOCAL_RANK": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
