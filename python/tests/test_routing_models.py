"""Routing of common models' parameters, by their modules and by their names alone. torchvision and
transformers are not installed: each model is a small lookalike with the real parameter names and module
types (torch.nn layers where the model has them, custom modules where it has its own)."""
import collections
import warnings

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")
from torch import nn  # noqa: E402

import normuon  # noqa: E402
from normuon.routing import infer_role  # noqa: E402

D, V = 16, 50  # hidden width and vocabulary: no hidden layer of the lookalikes maps onto V


class Node(nn.Module):
    """A custom module (not torch.nn): its own parameters are judged by their names, as a model's own
    modules' are. Children are modules or parameters, registered in the order given."""

    def __init__(*args, **children):
        self, = args  # children may be called "self" (BERT's attention.self)
        super(Node, self).__init__()
        for name, child in children.items():
            if isinstance(child, nn.Parameter):
                self.register_parameter(name, child)
            else:
                self.add_module(name, child)


def param(*shape):
    return nn.Parameter(torch.zeros(*shape))


def seq(**layers):
    return nn.Sequential(collections.OrderedDict(layers))


def bert_layer():
    """BERT/RoBERTa's encoder layer (BertLayer): attention.self.{query,key,value}, attention.output.dense,
    intermediate.dense, output.dense, LayerNorms."""
    return Node(attention=Node(self=Node(query=nn.Linear(D, D), key=nn.Linear(D, D), value=nn.Linear(D, D)),
                               output=Node(dense=nn.Linear(D, D), LayerNorm=nn.LayerNorm(D))),
                intermediate=Node(dense=nn.Linear(D, 4 * D)),
                output=Node(dense=nn.Linear(4 * D, D), LayerNorm=nn.LayerNorm(D)))


def bert_encoder(positions=20):
    return Node(embeddings=Node(word_embeddings=nn.Embedding(V, D), position_embeddings=nn.Embedding(positions, D),
                                token_type_embeddings=nn.Embedding(1, D), LayerNorm=nn.LayerNorm(D)),
                encoder=Node(layer=nn.ModuleList([bert_layer()])))


def roberta_for_masked_lm(tied=True):
    """RobertaForMaskedLM: roberta.*, lm_head = RobertaLMHead(dense, layer_norm, decoder, bias); the decoder
    is tied to the word embeddings (its bias is lm_head.bias)."""
    model = Node(roberta=bert_encoder(), lm_head=Node(dense=nn.Linear(D, D), layer_norm=nn.LayerNorm(D),
                                                      decoder=nn.Linear(D, V), bias=param(V)))
    model.lm_head.decoder.bias = model.lm_head.bias
    if tied:
        model.lm_head.decoder.weight = model.roberta.embeddings.word_embeddings.weight
    return model


def roberta_for_sequence_classification():
    """RobertaForSequenceClassification: classifier = RobertaClassificationHead(dense, dropout, out_proj)."""
    return Node(roberta=bert_encoder(), classifier=Node(dense=nn.Linear(D, D), dropout=nn.Dropout(0.1),
                                                        out_proj=nn.Linear(D, 3)))


def bert_for_masked_lm(tied=True):
    """BertForMaskedLM: bert.*, cls.predictions = BertLMPredictionHead(transform(dense, LayerNorm), decoder,
    bias), the decoder tied to the word embeddings."""
    model = Node(bert=bert_encoder(), cls=Node(predictions=Node(
        transform=Node(dense=nn.Linear(D, D), LayerNorm=nn.LayerNorm(D)), decoder=nn.Linear(D, V), bias=param(V))))
    model.cls.predictions.decoder.bias = model.cls.predictions.bias
    if tied:
        model.cls.predictions.decoder.weight = model.bert.embeddings.word_embeddings.weight
    return model


def bert_for_sequence_classification():
    """BertForSequenceClassification: bert.* with its pooler (dense), dropout, classifier."""
    model = Node(bert=bert_encoder(), dropout=nn.Dropout(0.1), classifier=nn.Linear(D, 2))
    model.bert.add_module("pooler", Node(dense=nn.Linear(D, D)))
    return model


def bottleneck(c_in, c):
    return Node(conv1=nn.Conv2d(c_in, c, 1, bias=False), bn1=nn.BatchNorm2d(c),
                conv2=nn.Conv2d(c, c, 3, bias=False), bn2=nn.BatchNorm2d(c),
                conv3=nn.Conv2d(c, 4 * c, 1, bias=False), bn3=nn.BatchNorm2d(4 * c),
                downsample=nn.Sequential(nn.Conv2d(c_in, 4 * c, 1, bias=False), nn.BatchNorm2d(4 * c)))


def resnet(num_classes=10):
    """torchvision's ResNet: conv1, bn1, layer1..4 of Bottlenecks (convolutions, 4-D), avgpool, fc."""
    return Node(conv1=nn.Conv2d(3, 8, 7, bias=False), bn1=nn.BatchNorm2d(8), relu=nn.ReLU(),
                layer1=nn.Sequential(bottleneck(8, 8)), layer2=nn.Sequential(bottleneck(32, 16)),
                avgpool=nn.AdaptiveAvgPool2d(1), fc=nn.Linear(64, num_classes))


class MLPBlock(nn.Sequential):  # torchvision's (a Sequential subclass of its own): Linear, GELU, Dropout, ...
    def __init__(self, d, mlp):
        super().__init__(nn.Linear(d, mlp), nn.GELU(), nn.Dropout(0.0), nn.Linear(mlp, d), nn.Dropout(0.0))


def vision_transformer(num_classes=10, representation_size=None):
    """torchvision's VisionTransformer: class_token, conv_proj, encoder(pos_embedding, layers of
    EncoderBlock(ln_1, self_attention = nn.MultiheadAttention, ln_2, mlp), ln), heads = Sequential(head) or
    Sequential(pre_logits, act, head)."""
    block = Node(ln_1=nn.LayerNorm(D), self_attention=nn.MultiheadAttention(D, 2, batch_first=True),
                 ln_2=nn.LayerNorm(D), mlp=MLPBlock(D, 4 * D))
    heads = seq(head=nn.Linear(D, num_classes)) if representation_size is None else \
        seq(pre_logits=nn.Linear(D, representation_size), act=nn.Tanh(), head=nn.Linear(representation_size, num_classes))
    return Node(class_token=param(1, 1, D), conv_proj=nn.Conv2d(3, D, 4, 4),
                encoder=Node(pos_embedding=param(1, 5, D), layers=seq(encoder_layer_0=block), ln=nn.LayerNorm(D)),
                heads=heads)


def vgg(num_classes=10):
    """torchvision's VGG: features (convolutions), avgpool, classifier = Sequential(Linear, ReLU, Dropout,
    Linear, ReLU, Dropout, Linear)."""
    return Node(features=nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()), avgpool=nn.AdaptiveAvgPool2d(2),
                classifier=nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Dropout(), nn.Linear(48, 48), nn.ReLU(),
                                         nn.Dropout(), nn.Linear(48, num_classes)))


class T5LayerNorm(nn.Module):  # T5's own RMS norm: a weight, no bias
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


def t5_stack(shared, relative):
    attention = Node(q=nn.Linear(D, D, bias=False), k=nn.Linear(D, D, bias=False), v=nn.Linear(D, D, bias=False),
                     o=nn.Linear(D, D, bias=False))
    if relative:
        attention.add_module("relative_attention_bias", nn.Embedding(32, 4))
    stack = Node(embed_tokens=nn.Embedding(V, D), block=nn.ModuleList([Node(layer=nn.ModuleList([
        Node(SelfAttention=attention, layer_norm=T5LayerNorm(D))]))]), final_layer_norm=T5LayerNorm(D))
    stack.embed_tokens.weight = shared.weight
    return stack


def t5_for_conditional_generation():
    """T5ForConditionalGeneration (v1.1: untied lm_head): shared, encoder/decoder stacks whose embed_tokens
    are the shared table, relative_attention_bias = nn.Embedding(num_buckets, n_heads) in the first block."""
    shared = nn.Embedding(V, D)
    return Node(shared=shared, encoder=t5_stack(shared, True), decoder=t5_stack(shared, True),
                lm_head=nn.Linear(D, V, bias=False))


def detr(num_classes=7, num_queries=12):
    """facebookresearch/detr's DETR: backbone (convolutions), input_proj (Conv2d), query_embed (nn.Embedding),
    transformer (nn.MultiheadAttention, linear1/linear2, norms), class_embed = Linear(hidden, classes + 1),
    bbox_embed = MLP(layers = ModuleList of Linear, hidden -> hidden -> 4)."""
    layer = Node(self_attn=nn.MultiheadAttention(D, 2), linear1=nn.Linear(D, 4 * D), linear2=nn.Linear(4 * D, D),
                 norm1=nn.LayerNorm(D), norm2=nn.LayerNorm(D))
    return Node(transformer=Node(encoder=Node(layers=nn.ModuleList([layer]))),
                class_embed=nn.Linear(D, num_classes + 1),
                bbox_embed=Node(layers=nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 4)])),
                query_embed=nn.Embedding(num_queries, D), input_proj=nn.Conv2d(8, D, 1),
                backbone=nn.Sequential(nn.Conv2d(3, 8, 3)))


def ldm_unet(c=8):
    """The latent-diffusion / guided-diffusion UNetModel: time_embed = Sequential(Linear, SiLU, Linear),
    input_blocks of convolutions and ResBlocks (in_layers, emb_layers = Sequential(SiLU, Linear), out_layers),
    out (GroupNorm, SiLU, Conv2d). No embedding table, no head."""
    res = Node(in_layers=nn.Sequential(nn.GroupNorm(2, c), nn.SiLU(), nn.Conv2d(c, c, 3)),
               emb_layers=nn.Sequential(nn.SiLU(), nn.Linear(4 * c, c)),
               out_layers=nn.Sequential(nn.GroupNorm(2, c), nn.SiLU(), nn.Conv2d(c, c, 3)))
    return Node(time_embed=nn.Sequential(nn.Linear(c, 4 * c), nn.SiLU(), nn.Linear(4 * c, 4 * c)),
                input_blocks=nn.ModuleList([nn.Conv2d(4, c, 3), res]),
                out=nn.Sequential(nn.GroupNorm(2, c), nn.SiLU(), nn.Conv2d(c, 4, 3)))


def diffusers_unet(c=8):
    """diffusers' UNet2DConditionModel: time_embedding = TimestepEmbedding(linear_1, act, linear_2), ResNet
    blocks with time_emb_proj, conv_out."""
    return Node(conv_in=nn.Conv2d(4, c, 3),
                time_embedding=Node(linear_1=nn.Linear(c, 4 * c), act=nn.SiLU(), linear_2=nn.Linear(4 * c, 4 * c)),
                down_blocks=nn.ModuleList([Node(resnets=nn.ModuleList([Node(
                    conv1=nn.Conv2d(c, c, 3), time_emb_proj=nn.Linear(4 * c, c), conv2=nn.Conv2d(c, c, 3))]))]),
                conv_out=nn.Conv2d(c, 4, 3))


def gpt_neox():
    """GPTNeoXForCausalLM: gpt_neox.embed_in, layers (attention.query_key_value, attention.dense,
    mlp.dense_h_to_4h, mlp.dense_4h_to_h), final_layer_norm, embed_out (untied)."""
    return Node(gpt_neox=Node(embed_in=nn.Embedding(V, D), layers=nn.ModuleList([Node(
        input_layernorm=nn.LayerNorm(D), attention=Node(query_key_value=nn.Linear(D, 3 * D), dense=nn.Linear(D, D)),
        mlp=Node(dense_h_to_4h=nn.Linear(D, 4 * D), dense_4h_to_h=nn.Linear(4 * D, D)))]),
        final_layer_norm=nn.LayerNorm(D)), embed_out=nn.Linear(D, V, bias=False))


class OpenAICLIP(nn.Module):
    """openai/CLIP's CLIP: visual (VisionTransformer: conv1, class_embedding, positional_embedding, ln_pre,
    transformer, ln_post, proj), transformer, token_embedding, positional_embedding, ln_final,
    text_projection, logit_scale: the projections and positional tables are bare Parameters."""

    def __init__(self, width=D, embed=12, ctx=8):
        super().__init__()
        resblock = lambda: Node(attn=nn.MultiheadAttention(width, 2), ln_1=nn.LayerNorm(width),  # noqa: E731
                                mlp=seq(c_fc=nn.Linear(width, 4 * width), gelu=nn.GELU(),
                                        c_proj=nn.Linear(4 * width, width)), ln_2=nn.LayerNorm(width))
        self.visual = Node(conv1=nn.Conv2d(3, width, 4, 4, bias=False), class_embedding=param(width),
                           positional_embedding=param(5, width), ln_pre=nn.LayerNorm(width),
                           transformer=Node(resblocks=nn.Sequential(resblock())), ln_post=nn.LayerNorm(width),
                           proj=param(width, embed))
        self.transformer = Node(resblocks=nn.Sequential(resblock()))
        self.token_embedding = nn.Embedding(V, width)
        self.positional_embedding = param(ctx, width)
        self.ln_final = nn.LayerNorm(width)
        self.text_projection = param(width, embed)
        self.logit_scale = nn.Parameter(torch.ones([]))


def hf_clip(width=D, embed=12):
    """transformers' CLIPModel: text_model (embeddings.token_embedding, embeddings.position_embedding),
    vision_model (embeddings.class_embedding, patch_embedding, position_embedding), visual_projection,
    text_projection (nn.Linear, no bias), logit_scale."""
    mlp = lambda: Node(fc1=nn.Linear(width, 4 * width), fc2=nn.Linear(4 * width, width))  # noqa: E731
    layer = lambda: Node(self_attn=Node(k_proj=nn.Linear(width, width), v_proj=nn.Linear(width, width),  # noqa: E731
                                        q_proj=nn.Linear(width, width), out_proj=nn.Linear(width, width)),
                         layer_norm1=nn.LayerNorm(width), mlp=mlp(), layer_norm2=nn.LayerNorm(width))
    return Node(text_model=Node(embeddings=Node(token_embedding=nn.Embedding(V, width),
                                                position_embedding=nn.Embedding(8, width)),
                                encoder=Node(layers=nn.ModuleList([layer()])), final_layer_norm=nn.LayerNorm(width)),
                vision_model=Node(embeddings=Node(class_embedding=param(width), patch_embedding=nn.Conv2d(3, width, 4, 4),
                                                  position_embedding=nn.Embedding(5, width)),
                                  encoder=Node(layers=nn.ModuleList([layer()])), post_layernorm=nn.LayerNorm(width)),
                visual_projection=nn.Linear(width, embed, bias=False), text_projection=nn.Linear(width, embed, bias=False),
                logit_scale=nn.Parameter(torch.ones([])))


def whisper():
    """WhisperForConditionalGeneration: model.encoder (conv1, conv2, embed_positions, layers, layer_norm),
    model.decoder (embed_tokens, embed_positions, layers, layer_norm), proj_out tied to embed_tokens."""
    layer = lambda: Node(self_attn=Node(k_proj=nn.Linear(D, D, bias=False), v_proj=nn.Linear(D, D),  # noqa: E731
                                        q_proj=nn.Linear(D, D), out_proj=nn.Linear(D, D)),
                         fc1=nn.Linear(D, 4 * D), fc2=nn.Linear(4 * D, D), final_layer_norm=nn.LayerNorm(D))
    model = Node(model=Node(
        encoder=Node(conv1=nn.Conv1d(8, D, 3), conv2=nn.Conv1d(D, D, 3), embed_positions=nn.Embedding(30, D),
                     layers=nn.ModuleList([layer()]), layer_norm=nn.LayerNorm(D)),
        decoder=Node(embed_tokens=nn.Embedding(V, D), embed_positions=nn.Embedding(20, D),
                     layers=nn.ModuleList([layer()]), layer_norm=nn.LayerNorm(D))),
        proj_out=nn.Linear(D, V, bias=False))
    model.proj_out.weight = model.model.decoder.embed_tokens.weight
    return model


def llama():
    """LlamaForCausalLM: model.embed_tokens, model.layers (self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
    RMS norms), model.norm, lm_head."""
    return Node(model=Node(embed_tokens=nn.Embedding(V, D), layers=nn.ModuleList([Node(
        self_attn=Node(q_proj=nn.Linear(D, D, bias=False), k_proj=nn.Linear(D, D, bias=False),
                       v_proj=nn.Linear(D, D, bias=False), o_proj=nn.Linear(D, D, bias=False)),
        mlp=Node(gate_proj=nn.Linear(D, 4 * D, bias=False), up_proj=nn.Linear(D, 4 * D, bias=False),
                 down_proj=nn.Linear(4 * D, D, bias=False)),
        input_layernorm=T5LayerNorm(D), post_attention_layernorm=T5LayerNorm(D))]), norm=T5LayerNorm(D)),
        lm_head=nn.Linear(D, V, bias=False))


def mamba():
    """MambaForCausalLM: backbone.embeddings, backbone.layers.N.mixer (in_proj, conv1d, x_proj, dt_proj,
    out_proj), backbone.norm_f, lm_head tied to the embeddings."""
    model = Node(backbone=Node(embeddings=nn.Embedding(V, D), layers=nn.ModuleList([Node(norm=T5LayerNorm(D), mixer=Node(
        in_proj=nn.Linear(D, 4 * D, bias=False), conv1d=nn.Conv1d(2 * D, 2 * D, 4, groups=2 * D),
        x_proj=nn.Linear(2 * D, 9, bias=False), dt_proj=nn.Linear(1, 2 * D), out_proj=nn.Linear(2 * D, D, bias=False)))]),
        norm_f=T5LayerNorm(D)), lm_head=nn.Linear(D, V, bias=False))
    model.lm_head.weight = model.backbone.embeddings.weight
    return model


def nanogpt(tied=True):
    """nanoGPT / GPT-2: transformer.wte, transformer.wpe, transformer.h.N (ln_1, attn.c_attn, attn.c_proj,
    ln_2, mlp.c_fc, mlp.c_proj), transformer.ln_f, lm_head (tied)."""
    model = Node(transformer=Node(wte=nn.Embedding(V, D), wpe=nn.Embedding(20, D), h=nn.ModuleList([Node(
        ln_1=nn.LayerNorm(D), attn=Node(c_attn=nn.Linear(D, 3 * D), c_proj=nn.Linear(D, D)), ln_2=nn.LayerNorm(D),
        mlp=Node(c_fc=nn.Linear(D, 4 * D), c_proj=nn.Linear(4 * D, D)))]), ln_f=nn.LayerNorm(D)),
        lm_head=nn.Linear(D, V, bias=False))
    if tied:
        model.lm_head.weight = model.transformer.wte.weight
    return model


def routed(model, warns=None, **kw):
    """{name: routing row} of NorMuonAdamW(model), with any warning an error but one matching `warns`."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if warns is not None:
            warnings.filterwarnings("ignore", message=warns)
        opt = normuon.NorMuonAdamW(model, **kw)
    return {r["name"]: r for r in opt.routing_table()}


def by_names(model):
    """{name: role} by the names alone (infer_role), as bare tensors are routed."""
    return {n: infer_role(n, tuple(p.shape)) for n, p in model.named_parameters()}


def algorithm(role, shape):
    return "normuon" if len(shape) == 2 and role not in ("embedding", "head") else "adamw"


# (model, {name: (role by the modules, role by the names)}) for the parameters that common models misrouted
# or that are easy to misroute. "matrix" is a 2-D hidden matrix: NorMuon; embedding and head: AdamW.
CASES = {
    "roberta_mlm": (roberta_for_masked_lm, {
        "roberta.embeddings.word_embeddings.weight": ("embedding", "embedding"),
        "roberta.embeddings.position_embeddings.weight": ("embedding", "embedding"),
        "roberta.embeddings.token_type_embeddings.weight": ("embedding", "embedding"),
        "roberta.embeddings.LayerNorm.weight": ("norm", "norm"),
        "roberta.encoder.layer.0.output.dense.weight": ("matrix", "matrix"),
        "lm_head.dense.weight": ("matrix", "matrix"),  # gap 1: was the head, on AdamW
        "lm_head.layer_norm.weight": ("norm", "norm"),
        "lm_head.bias": ("bias", "bias"),
    }),
    "roberta_mlm_untied": (lambda: roberta_for_masked_lm(tied=False), {
        "lm_head.dense.weight": ("matrix", "matrix"),
        "lm_head.decoder.weight": ("head", "head"),
    }),
    "roberta_classification": (roberta_for_sequence_classification, {
        "classifier.dense.weight": ("matrix", "matrix"),
        "classifier.out_proj.weight": ("head", "head"),
    }),
    "bert_mlm": (bert_for_masked_lm, {
        "bert.embeddings.word_embeddings.weight": ("embedding", "embedding"),
        "cls.predictions.transform.dense.weight": ("matrix", "matrix"),
        "cls.predictions.bias": ("bias", "bias"),
    }),
    "bert_mlm_untied": (lambda: bert_for_masked_lm(tied=False), {
        "cls.predictions.transform.dense.weight": ("matrix", "matrix"),
        "cls.predictions.decoder.weight": ("head", "head"),
    }),
    "lm_head_transform_only": (lambda: Node(  # logits from the embedding's weight by hand: the head module
            wte=nn.Embedding(V, D), h=nn.Sequential(nn.Linear(D, 4 * D), nn.Linear(4 * D, D)),  # holds no head
            lm_head=Node(dense=nn.Linear(D, D), layer_norm=nn.LayerNorm(D))), {
        "lm_head.dense.weight": ("matrix", "matrix"),
    }),
    "bert_classification": (bert_for_sequence_classification, {
        "bert.pooler.dense.weight": ("matrix", "matrix"),
        "classifier.weight": ("head", "head"),
    }),
    "resnet": (resnet, {  # gap 2: fc was a hidden matrix, on NorMuon
        "fc.weight": ("head", "head"),
        "fc.bias": ("bias", "bias"),
        "conv1.weight": ("other", "other"),
        "layer1.0.bn1.weight": ("other", "other"),  # a BatchNorm's weight: 1-D, AdamW either way
    }),
    "vit": (vision_transformer, {  # gap 2: heads.head was a hidden matrix
        "heads.head.weight": ("head", "head"),
        "encoder.layers.encoder_layer_0.self_attention.in_proj_weight": ("matrix", "matrix"),
        "encoder.layers.encoder_layer_0.self_attention.out_proj.weight": ("matrix", "matrix"),
        "encoder.layers.encoder_layer_0.mlp.0.weight": ("matrix", "matrix"),
        "class_token": ("other", "other"),
        "encoder.pos_embedding": ("embedding", "embedding"),
    }),
    "vit_pre_logits": (lambda: vision_transformer(representation_size=24), {
        "heads.pre_logits.weight": ("matrix", "matrix"),
        "heads.head.weight": ("head", "head"),
    }),
    "vgg": (vgg, {  # by the names alone a Sequential's layers cannot be told apart: all of them are the head
        "classifier.0.weight": ("matrix", "head"),
        "classifier.3.weight": ("matrix", "head"),
        "classifier.6.weight": ("head", "head"),
    }),
    "t5": (t5_for_conditional_generation, {  # gap 3: relative_attention_bias by name was a hidden matrix
        "shared.weight": ("embedding", "embedding"),
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": ("embedding", "embedding"),
        "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": ("embedding", "embedding"),
        "encoder.block.0.layer.0.SelfAttention.q.weight": ("matrix", "matrix"),
        "encoder.block.0.layer.0.layer_norm.weight": ("norm", "norm"),
        "lm_head.weight": ("head", "head"),
    }),
    "detr": (detr, {  # gap 4: class_embed by name was an embedding (AdamW, but as an embedding)
        "class_embed.weight": ("head", "head"),
        "query_embed.weight": ("embedding", "embedding"),
        "bbox_embed.layers.0.weight": ("matrix", "matrix"),  # by name: was an embedding (AdamW)
        "bbox_embed.layers.2.weight": ("matrix", "matrix"),
        "transformer.encoder.layers.0.self_attn.in_proj_weight": ("matrix", "matrix"),
    }),
    "ldm_unet": (ldm_unet, {  # gap 4: time_embed's Linears by name were embeddings (AdamW)
        "time_embed.0.weight": ("matrix", "matrix"),
        "time_embed.2.weight": ("matrix", "matrix"),
        "input_blocks.1.emb_layers.1.weight": ("matrix", "matrix"),
    }),
    "diffusers_unet": (diffusers_unet, {
        "time_embedding.linear_1.weight": ("matrix", "matrix"),
        "time_embedding.linear_2.weight": ("matrix", "matrix"),
        "down_blocks.0.resnets.0.time_emb_proj.weight": ("matrix", "matrix"),
    }),
    "gpt_neox": (gpt_neox, {
        "gpt_neox.embed_in.weight": ("embedding", "embedding"),
        "embed_out.weight": ("head", "head"),  # by name: was an embedding (AdamW, but as an embedding)
        "gpt_neox.layers.0.attention.dense.weight": ("matrix", "matrix"),
    }),
    "llama": (llama, {
        "model.embed_tokens.weight": ("embedding", "embedding"),
        "model.layers.0.self_attn.q_proj.weight": ("matrix", "matrix"),
        "model.layers.0.mlp.down_proj.weight": ("matrix", "matrix"),
        "model.norm.weight": ("norm", "norm"),
        "lm_head.weight": ("head", "head"),
    }),
    "mamba": (mamba, {
        "backbone.embeddings.weight": ("embedding", "embedding"),
        "backbone.layers.0.mixer.in_proj.weight": ("matrix", "matrix"),
        "backbone.layers.0.mixer.x_proj.weight": ("matrix", "matrix"),
        "backbone.layers.0.mixer.conv1d.weight": ("other", "other"),
    }),
    "nanogpt": (nanogpt, {
        "transformer.wte.weight": ("embedding", "embedding"),
        "transformer.wpe.weight": ("embedding", "embedding"),
        "transformer.h.0.attn.c_attn.weight": ("matrix", "matrix"),
        "transformer.h.0.mlp.c_fc.weight": ("matrix", "matrix"),
    }),
    "nanogpt_untied": (lambda: nanogpt(tied=False), {"lm_head.weight": ("head", "head")}),
    "openai_clip": (OpenAICLIP, {
        "token_embedding.weight": ("embedding", "embedding"),
        "positional_embedding": ("embedding", "embedding"),
        "visual.positional_embedding": ("embedding", "embedding"),
        "visual.class_embedding": ("embedding", "embedding"),
        "text_projection": ("head", "head"),  # the text tower's output layer: was a hidden matrix
        "visual.proj": ("head", "head"),      # the image tower's: was a hidden matrix
        "transformer.resblocks.0.mlp.c_fc.weight": ("matrix", "matrix"),
    }),
    "hf_clip": (hf_clip, {
        "text_model.embeddings.token_embedding.weight": ("embedding", "embedding"),
        "text_model.embeddings.position_embedding.weight": ("embedding", "embedding"),
        "vision_model.embeddings.position_embedding.weight": ("embedding", "embedding"),
        "vision_model.embeddings.patch_embedding.weight": ("other", "embedding"),  # a convolution: AdamW either way
        "text_projection.weight": ("head", "head"),
        "visual_projection.weight": ("head", "head"),
        "text_model.encoder.layers.0.mlp.fc1.weight": ("matrix", "matrix"),
    }),
    "whisper": (whisper, {
        "model.encoder.embed_positions.weight": ("embedding", "embedding"),
        "model.decoder.embed_tokens.weight": ("embedding", "embedding"),
        "model.decoder.embed_positions.weight": ("embedding", "embedding"),
        "model.encoder.layers.0.fc1.weight": ("matrix", "matrix"),
        "model.encoder.conv1.weight": ("other", "other"),
    }),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_common_models_route_by_their_modules(case, native):
    make, expected = CASES[case]
    # The modules tell everything (no warning), but for DETR's box regressor (an output layer they do not name).
    rows = routed(make(), warns="NorMuonAdamW: 'bbox_embed.layers.2.weight'" if case == "detr" else None)
    for name, (role, _) in expected.items():
        row = rows[name]
        assert (name, row["role"]) == (name, role)
        assert (name, row["algorithm"]) == (name, algorithm(role, row["shape"]))
    # Every 2-D hidden matrix of a torch.nn layer, and no other tensor, is on NorMuon.
    roles = {n: r["role"] for n, r in rows.items()}
    assert {n for n, r in rows.items() if r["algorithm"] == "normuon"} == \
        {n for n, r in rows.items() if len(r["shape"]) == 2 and roles[n] not in ("embedding", "head")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_common_models_route_by_their_names(case):
    make, expected = CASES[case]
    roles = by_names(make())
    assert {n: roles[n] for n in expected} == {n: by_name for n, (_, by_name) in expected.items()}


@pytest.mark.parametrize("name,shape,role", [
    ("lm_head.dense.weight", (D, D), "matrix"),                          # RoBERTa's LM head transform
    ("module.lm_head.dense.weight", (D, D), "matrix"),
    ("deberta.lm_predictions.lm_head.dense.weight", (D, D), "matrix"),
    ("lm_head.decoder.weight", (V, D), "head"),
    ("classifier.dense.weight", (D, D), "matrix"),
    ("classifier.out_proj.weight", (3, D), "head"),
    ("head.pre_logits.fc.weight", (D, D), "matrix"),                     # timm's NormMlpClassifierHead
    ("head.fc.weight", (10, D), "head"),
    ("fc.weight", (1000, 2048), "head"),                                 # ResNet
    ("_orig_mod.fc.weight", (1000, 2048), "head"),
    ("layer4.0.fc.weight", (D, D), "matrix"),                            # an fc inside the model
    ("heads.head.weight", (1000, 768), "head"),                          # torchvision ViT
    ("heads.pre_logits.weight", (768, 768), "matrix"),
    ("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", (32, 8), "embedding"),  # T5
    ("features.0.0.attn.relative_position_bias_table", (169, 4), "embedding"),                   # Swin
    ("class_embed.weight", (92, 256), "head"),                           # DETR
    ("class_embed.3.weight", (92, 256), "head"),                         # Deformable DETR (one per layer)
    ("bbox_embed.layers.1.weight", (256, 256), "matrix"),
    ("query_embed.weight", (100, 256), "embedding"),
    ("time_embed.0.weight", (1280, 320), "matrix"),                      # LDM / guided diffusion
    ("model.diffusion_model.time_embed.2.weight", (1280, 1280), "matrix"),
    ("time_embed.weight", (1000, 64), "embedding"),                      # a table of timesteps
    ("time_embedding.linear_1.weight", (1280, 320), "matrix"),           # diffusers
    ("add_embedding.linear_2.weight", (1280, 1280), "matrix"),
    ("t_embedder.mlp.0.weight", (1152, 256), "matrix"),                  # DiT
    ("y_embedder.embedding_table.weight", (1001, 1152), "embedding"),
    ("label_emb.weight", (1000, 1280), "embedding"),
    ("decoder.embed_tokens.0.weight", (2048, 1024), "embedding"),        # MusicGen: one table per codebook
    ("embed.W_E", (V, D), "embedding"),                                  # TransformerLens
    ("pos_embed.W_pos", (8, D), "embedding"),
    ("unembed.W_U", (D, V), "head"),
    ("embed_out.weight", (V, D), "head"),                                # GPT-NeoX
    ("gpt_neox.embed_in.weight", (V, D), "embedding"),
    ("model.embed_tokens.weight", (V, D), "embedding"),
    ("transformer.wte.weight", (V, D), "embedding"),
    ("transformer.wpe.weight", (20, D), "embedding"),
    ("backbone.embeddings.weight", (V, D), "embedding"),                 # Mamba (transformers)
    ("backbone.embedding.weight", (V, D), "embedding"),                  # mamba_ssm
    ("token_embedding.weight", (V, D), "embedding"),                     # CLIP
    ("positional_embedding", (8, D), "embedding"),
    ("text_projection", (D, 12), "head"),
    ("visual.proj", (D, 12), "head"),
    ("transformer.visual.proj", (D, D), "matrix"),                       # Qwen-VL: inside the model, not its output
    ("visual_projection.weight", (12, D), "head"),
    ("model.encoder.embed_positions.weight", (30, D), "embedding"),      # Whisper
    ("model.decoder.embed_positions.weight", (20, D), "embedding"),
    ("bert.embeddings.LayerNorm.weight", (D,), "norm"),                  # inside an embeddings module: a norm
    ("embeddings.patch_embeddings.projection.weight", (D, 3, 4, 4), "other"),
    ("v_head.summary.weight", (1, D), "head"),                           # TRL's value head
])
def test_name_rules_of_common_models(name, shape, role):
    assert infer_role(name, shape) == role


def test_torch_layers_never_take_an_embedding_role_from_their_names(native):
    # nn.Linear layers named as embeddings (DETR's bbox_embed, a UNet's time_embed, an embed_proj) are hidden
    # matrices when the model is given: only an nn.Embedding (or a tensor tied to one) is an embedding.
    model = Node(tok=nn.Embedding(V, D), embed_proj=nn.Linear(D, D), time_embed=nn.Sequential(nn.Linear(D, D)),
                 pos_emb=nn.Linear(D, D), wte=nn.Linear(D, D), blocks=nn.Sequential(nn.Linear(D, D)),
                 lm_head=nn.Linear(D, V))
    rows = routed(model)
    for name in ("embed_proj.weight", "time_embed.0.weight", "pos_emb.weight", "wte.weight"):
        assert rows[name]["role"] == "matrix" and rows[name]["algorithm"] == "normuon"
    assert rows["tok.weight"]["role"] == "embedding" and rows["lm_head.weight"]["role"] == "head"


@pytest.mark.parametrize("make,layer,out", [
    (lambda: nn.Sequential(nn.Linear(8, D), nn.ReLU(), nn.Linear(D, D), nn.ReLU(), nn.Linear(D, 3)), "4", 3),
    (lambda: detr(), "bbox_embed.layers.2", 4),  # a second output layer beside class_embed
    (lambda: Node(fc=nn.Linear(8, D), out=nn.Linear(D, 3)), "out", 3),  # 'fc' named as a head is not the last
])
def test_an_output_layer_the_names_do_not_reveal_warns(make, layer, out, native):
    # No embedding tells the head and no name does: the last layer, whose output width no other layer has,
    # is likely the output layer. It stays on NorMuon (the modules do not say it is the head) but not silently.
    with pytest.warns(UserWarning, match=rf"'{layer}\.weight' \({out}x\d+\) is the last layer(.|\n)*"
                                         rf"roles=\{{'{layer}\.weight': 'head'\}}(.|\n)*{layer}\.weight +{out}x"):
        opt = normuon.NorMuonAdamW(make())
    row = {r["name"]: r for r in opt.routing_table()}[f"{layer}.weight"]
    assert row["algorithm"] == "normuon"
    # Saying what it is ends the warning: roles= (a head: AdamW) or an override (NorMuon, on purpose).
    rows = routed(make(), roles={f"{layer}.weight": "head"})
    assert rows[f"{layer}.weight"]["algorithm"] == "adamw" and rows[f"{layer}.weight"]["why"] == "rule: head (roles=)"
    assert routed(make(), overrides={f"{layer}.weight": "normuon"})[f"{layer}.weight"]["why"] == "override"


@pytest.mark.parametrize("make", [
    lambda: nn.Sequential(nn.Linear(8, D), nn.ReLU(), nn.Linear(D, 8)),  # output width = input width
    lambda: nn.Linear(8, 3),                                             # one layer: nothing to tell apart
    ldm_unet, diffusers_unet,                                            # the last Linear feeds the network
    lambda: bert_encoder(),                                              # an encoder without a head
])
def test_no_warning_where_the_last_layer_is_no_output_layer(make, native):
    routed(make())
