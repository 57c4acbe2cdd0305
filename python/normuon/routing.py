"""Roles: which parameters are embeddings and which is the output head (the spec's routing rule reads them,
docs/spec.md section 2). From the model's modules where there is one, from names only as the fallback
(docs/python.md, Routing).

Module evidence (NorMuonAdamW(model) or model=): the weight of an nn.Embedding / nn.EmbeddingBag, or any
tensor tied to one, is an embedding; the head is the layer from the token embedding's width onto its
vocabulary (the token embedding: the largest table not named as positions; a tied head is the embedding and
ends the search), and the last layer of a module named as a head (the layers before it in that module feed
it: RoBERTa's lm_head.dense). With no head from the vocabulary, a last layer whose output width no other
layer has may be the model's output layer: it stays a hidden matrix, with a warning.
Name evidence (bare tensors, named_parameters()): wrapper prefixes are stripped first (DDP's module.,
torch.compile's _orig_mod., model., FSDP's and checkpointing's wrappers).
A mixture-of-experts router, by name: a module named gate or router (or ..._gate: Qwen2-MoE's
shared_expert_gate) with an `experts` module beside it (Mixtral's mlp.gate, DeepSeek-V3's MoEGate, torchtitan's
moe.router.gate): its weight scores the experts, so it is a router, not a hidden matrix.
An expert bank, by name: a 3-D tensor [E, m, n] of an `experts` module (transformers 5.x MoE models'
experts.gate_up_proj and experts.down_proj, torchtitan's GroupedExperts' w1, w2, w3) holds E matrices, each
stepped by NorMuon as a matrix of its own; a tensor there named as a bias ([E, f]: gpt-oss) is biases.
A matrix stored transposed, [in, out] (transformers' Conv1D: GPT-2; the banks [E, in, out] of experts modules
that say is_transposed: gpt-oss; by their modules), has its neurons along the stored columns: NorMuon's
statistics and shape factor follow them (docs/spec.md section 2).
"""
import fnmatch
import math
import warnings

import torch

# Leading name components that wrappers add (DDP, torch.compile, Hugging Face, FSDP, activation checkpointing).
WRAPPER_PREFIXES = ("module", "_orig_mod", "model", "base_model", "_fsdp_wrapped_module",
                    "_checkpoint_wrapped_module")
# An embedding, by name: the tensor's owner -- the tensor itself when it is a bare Parameter (minGPT's pos_emb,
# CLIP's positional_embedding), else the module holding it, past list indices (MusicGen's embed_tokens.0) --
# contains "embed", ends in "_emb", or is one of these (T5's "shared" and relative_attention_bias, Swin's
# relative_position_bias_table). Layers inside an embedding block are not (BERT's embeddings.LayerNorm,
# diffusers' time_embedding.linear_1, DETR's bbox_embed.layers.0).
EMBEDDING_WORDS = ("wte", "wpe", "emb", "shared", "relative_attention_bias", "relative_position_bias_table")
# ...nor is a time embedding reached through a list index: a Sequential MLP (LDM's time_embed.0), not a table.
TIME_WORDS = ("time", "timestep")
# A head, by name: the module path starts with one of these (dotted: components that follow each other)...
HEAD_FIRST = ("lm_head", "head", "heads", "output", "classifier", "score", "fc", "embed_out", "unembed",
              "text_projection", "visual_projection", "visual.proj", "v_head", "value_head")
# ...or holds one of these anywhere (BERT's cls.predictions.decoder, DETR's class_embed, Megatron's output_layer).
HEAD_ANYWHERE = ("lm_head", "classifier", "class_embed", "output_layer", "predictions.decoder")
# Layers inside a head that transform its input, hidden matrices: RoBERTa's lm_head.dense and classifier.dense,
# timm's head.pre_logits.fc, torchvision ViT's heads.pre_logits.
HEAD_HIDDEN = ("dense", "transform", "pre_logits")
EMBEDDING_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)
ROUTER_WORDS = ("gate", "router")  # a router module's name, or its ending after "_"


def router_roles(names):
    """{name: ("router", evidence)} for the parameters of MoE routers among `names` (module docstring)."""
    beside = {n.split(".experts.")[0] for n in names if ".experts." in n}  # modules that hold experts
    beside |= {"" for n in names if n.startswith("experts.")}
    out = {}
    for name in names:
        parts = name.split(".")
        for i, part in enumerate(parts[:-1]):
            if (part.lower() in ROUTER_WORDS or part.lower().endswith(tuple("_" + w for w in ROUTER_WORDS))) \
                    and ".".join(parts[:i]) in beside:
                where = ".".join(parts[:i] + ["experts"])
                out[name] = ("router", f"'{'.'.join(parts[:i + 1])}' beside '{where}'")
                break
    return out


def expand_patterns(table, names, what):
    """{name: value} from a table of parameter names and glob patterns (fnmatch's *, ? and [...], matched
    against whole names): an exact name wins, then the first pattern in the table's order. A pattern that
    matches no name is a ValueError; exact names (a bank's experts' "x[0]" too) are left for the caller to check."""
    known = set(names)
    patterns = {k: v for k, v in table.items() if k not in known and any(c in k for c in "*?[")}
    out = {}
    for key, value in patterns.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, key)]
        if not hits:
            raise ValueError(f"{what} pattern {key!r} matches no parameter")
        for n in hits:
            out.setdefault(n, value)
    out.update({k: v for k, v in table.items() if k not in patterns})
    return out


def strip_wrappers(name):
    """The name without the leading components wrappers add: 'module._orig_mod.lm_head.weight' -> 'lm_head.weight'."""
    parts = name.split(".")
    while len(parts) > 1 and parts[0] in WRAPPER_PREFIXES:
        parts = parts[1:]
    return ".".join(parts)


def _embedding_named(component):
    return "embed" in component or component.endswith("_emb") or component in EMBEDDING_WORDS


def _looks_like_embedding(parts):
    if parts[-1] not in ("weight", "bias") and _embedding_named(parts[-1]):
        return True  # a bare Parameter named as an embedding
    i = len(parts) - 2  # the module holding the tensor, past list indices
    while i > 0 and parts[i].isdigit():
        i -= 1
    if i < 0 or not _embedding_named(parts[i]):
        return False
    return not (i < len(parts) - 2 and parts[i].startswith(TIME_WORDS))


def _head_root(parts):
    """The index of the component where the name first calls a module a head, or None."""
    ends = []
    for words, anywhere in ((HEAD_FIRST, False), (HEAD_ANYWHERE, True)):
        for word in words:
            k = word.split(".")
            starts = range(len(parts) - len(k) + 1) if anywhere else range(1 if len(parts) >= len(k) else 0)
            ends += [i + len(k) - 1 for i in starts if parts[i:i + len(k)] == k]
    return min(ends) if ends else None


def _looks_like_head(parts):
    root = _head_root(parts)
    return root is not None and not any(c in HEAD_HIDDEN for c in parts[root + 1:])


def infer_role(name, shape):
    """The manifest role of a parameter from its name and shape alone."""
    parts = strip_wrappers(name.lower()).split(".")
    if "experts" in parts[:-1]:  # inside a MoE's experts module: its biases ([E, f]: gpt-oss), or a bank [E, m, n]
        if "bias" in parts[-1]:
            return "bias"
        if len(shape) == 3:
            return "experts"
    if len(shape) == 2 and _looks_like_head(parts):  # first: GPT-NeoX's embed_out, DETR's class_embed are heads
        return "head"
    if _looks_like_embedding(parts):
        return "embedding"
    return _shape_role(parts, len(shape))


# torch.nn's containers: a parameter they hold directly (an expert bank in a bare nn.Module named experts) is
# told by its name, not by the class (module_roles).
CONTAINERS = (torch.nn.Module, torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential, torch.nn.ParameterList,
              torch.nn.ParameterDict)


def _torch_module(module):
    """A layer class from torch.nn itself: its parameters' roles follow from the class, not from names."""
    return type(module).__module__.startswith("torch.nn.") and type(module) not in CONTAINERS


def _conv1d(module):
    """transformers' Conv1D (GPT-2's c_attn, c_fc, c_proj: a linear layer whose weight is stored [in, out]), known
    by its class name (or a base's: fully_shard makes FSDPConv1D) and its output width nf, so that transformers
    need not be imported."""
    w = getattr(module, "weight", None)
    named = any(c.__name__ == "Conv1D" for c in type(module).__mro__)
    return named and isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[1] == getattr(module, "nf", None)


def transposed_weights(model):
    """{id(weight): evidence} of the matrices `model` stores [in, out]: Conv1D weights (_conv1d), and the expert
    banks [E, in, out] of transformers' experts modules that say is_transposed (gpt-oss; their biases are not)."""
    out = {}
    for name, m in model.named_modules():
        if _conv1d(m):
            out[id(m.weight)] = f"Conv1D '{name}'"
        elif getattr(m, "is_transposed", None) is True and hasattr(m, "has_gate"):  # @use_experts_implementation
            out.update({id(p): f"{type(m).__name__} '{name}' is_transposed" for pname, p in
                        m.named_parameters(recurse=False) if p.dim() == 3 and "bias" not in pname})
    return out


class _Doubt(str):
    """The evidence of a parameter the modules make a hidden matrix although it may be the output layer;
    output_layer_doubts names it unless roles= or overrides= said what it is."""

    def __new__(cls, evidence, message):
        doubt = super().__new__(cls, evidence)
        doubt.message = message
        return doubt


def module_roles(model):
    """{id(tensor): (role, evidence)} for the parameters of `model` whose role the modules tell: embeddings,
    the output head, and every other parameter of a torch.nn module (whose name must not make it an embedding).
    Parameters of custom modules are left to the names."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    roles, tables = {}, []
    for mname, m in model.named_modules():
        if isinstance(m, EMBEDDING_MODULES) and isinstance(getattr(m, "weight", None), torch.Tensor):
            roles[id(m.weight)] = ("embedding", f"{type(m).__name__} '{mname}'")
            tables.append((mname, m.weight))
    token = _token_embedding(tables)
    tied = token is not None and any(
        getattr(m, "weight", None) is token[1] for m in model.modules() if not isinstance(m, EMBEDDING_MODULES))
    candidates = []  # layers from the embedding's width onto its vocabulary (none to look for when tied)
    if token is not None and not tied:
        vocab, width = token[1].shape[0], token[1].shape[1] if token[1].dim() == 2 else None
        for mname, m in model.named_modules():
            w = getattr(m, "weight", None)
            if isinstance(m, EMBEDDING_MODULES) or not isinstance(w, torch.Tensor) or w.dim() != 2 or id(w) in roles:
                continue
            if w.shape[0] == vocab and w.shape[1] == width:
                candidates.append((mname, m, w))
    if len(candidates) > 1:  # several layers map onto the vocabulary: the one named a head, else the last one
        named = [c for c in candidates if _looks_like_head(strip_wrappers(f"{c[0]}.weight").lower().split("."))]
        chosen = named[-1] if named else candidates[-1]
        warnings.warn(f"NorMuonAdamW: {len(candidates)} layers map onto the vocabulary of {vocab} "
                      f"({', '.join(repr(c[0]) for c in candidates)}); '{chosen[0]}' is taken as the output head. "
                      "Check print_routing() and pass roles= or overrides= if that is wrong", stacklevel=4)
        candidates = [chosen]
    for mname, m, w in candidates:
        roles[id(w)] = ("head", f"{type(m).__name__} '{mname}' maps onto the vocabulary ({vocab})")
    named_heads = _named_heads(model, roles)
    for mname, m in model.named_modules():
        container = type(m) in CONTAINERS
        if not (_torch_module(m) or container or _conv1d(m)) or isinstance(m, EMBEDDING_MODULES):
            continue
        for pname, p in m.named_parameters(recurse=False):
            if id(p) not in roles:
                full = f"{mname}.{pname}" if mname else pname
                if container:  # the class says nothing: the name does (a bank in a bare module named experts)
                    roles[id(p)] = (infer_role(full, p.shape), f"name, in {type(m).__name__} '{mname}'")
                else:
                    roles[id(p)] = (_shape_role(strip_wrappers(full.lower()).split("."), p.dim()), type(m).__name__)
    if not tied and not candidates:
        _doubt_the_last_layer(model, roles, named_heads)
    return roles


def _named_heads(model, roles):
    """Adds to roles the heads that modules named as heads hold; their module paths. A module named as a head
    (lm_head, classifier, heads, fc, ...; a ModuleList / ModuleDict of them: Deformable DETR's class_embed.N)
    holds one head, its last 2-D weight of a torch.nn layer: the layers before it feed it (RoBERTa's
    lm_head.dense, VGG's classifier.0 and .3, ViT's heads.pre_logits), and a layer under a hidden component
    (HEAD_HIDDEN) is never the head. A module that holds the tied embedding or the head onto the vocabulary
    has its head already."""
    groups = []
    for mname, m in model.named_modules():
        parts = strip_wrappers(mname.lower()).split(".") if mname else []
        if not parts or _head_root(parts) != len(parts) - 1:
            continue  # not named as a head, or inside a module that is
        if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            groups += [(f"{mname}.{k}", c) for k, c in m.named_children()]
        else:
            groups.append((mname, m))
    found = []
    for gname, g in groups:
        members = [(f"{gname}.{sub}" if sub else gname, sm, p)
                   for sub, sm in g.named_modules(remove_duplicate=False) if _torch_module(sm)
                   for p in sm.parameters(recurse=False) if p.dim() == 2]
        if not members or any(roles.get(id(p), ("",))[0] in ("embedding", "head") for _, _, p in members):
            continue
        depth = len(gname.split("."))
        heads = [x for x in members if not any(c in HEAD_HIDDEN for c in x[0].lower().split(".")[depth:])]
        if heads:
            mname, m, p = heads[-1]
            roles[id(p)] = ("head", f"{type(m).__name__} '{mname}', named as a head")
            found.append(mname)
    return found


def _doubt_the_last_layer(model, roles, named_heads):
    """No head onto a vocabulary: the model's last 2-D weight of a torch.nn layer (registration order), when
    its output width (rows) is no other matrix's width, is likely the output layer (ResNet's fc, a classifier
    under a name of its own). When it is not a head already, its evidence says so (a _Doubt), and
    vocabulary_lookalikes warns. Its role stays: the modules did not say it is the head."""
    owners = {}  # id(tensor) -> the first module holding it
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), m)
    matrices = [(n, p) for n, p in model.named_parameters() if p.dim() == 2]
    layers = [(n, p) for n, p in matrices if _torch_module(owners[id(p)]) and
              not isinstance(owners[id(p)], EMBEDDING_MODULES) and roles.get(id(p), ("",))[0] != "embedding"]
    if len(layers) < 2:
        return
    name, last = layers[-1]
    if roles.get(id(last), ("",))[0] == "head" or any(
            last.shape[0] in p.shape for n, p in matrices if p is not last):
        return
    role, evidence = roles[id(last)]
    named = (f"the layers named as heads ({', '.join(repr(n) for n in named_heads)}) are not the last one"
             if named_heads else "no layer is named as a head")
    message = (f"'{name}' ({last.shape[0]}x{last.shape[1]}) is the last layer of the model and its output width "
               f"{last.shape[0]} is no other layer's, so it may be the model's output layer (the logits); no layer "
               f"maps onto a token embedding's vocabulary and {named}. It goes to NorMuon as a hidden matrix: if it "
               f"is an output layer, pass roles={{'{name}': 'head'}} (AdamW); if it is a hidden matrix, "
               f"overrides={{'{name}': 'normuon'}}")
    roles[id(last)] = (role, _Doubt(evidence, message))


# Embedding tables that hold positions, not tokens: never the vocabulary a head maps onto.
POSITION_WORDS = ("wpe", "pos", "position", "positions", "pos_emb", "position_embeddings", "relative")


def _token_embedding(tables):
    """(name, weight) of the token embedding among the embedding tables: the largest of those not named
    as positions (nanoGPT's wpe can be larger than a character vocabulary), else the largest."""
    def positional(name):
        return any(w in c for c in strip_wrappers(name.lower()).split(".") for w in POSITION_WORDS)

    pool = [t for t in tables if not positional(t[0])] or tables
    return max(pool, key=lambda t: t[1].shape[0]) if pool else None


def _shape_role(parts, ndim):
    if ndim == 2:
        return "matrix"
    if ndim < 2:
        if parts[-1] == "bias":
            return "bias"
        if any("norm" in c for c in parts) or any(c.startswith("ln") for c in parts):
            return "norm"
    return "other"


def vocabulary_lookalikes(entries):
    """Entries routed to NorMuon by the rule on name evidence that look like an output head or an embedding
    the names did not reveal: the shape of the token embedding (_token_embedding) either way round, or,
    when no embedding is known, a matrix holding the vocabulary-like dimension (the largest dimension of all
    matrices, at least twice any other, in at most two of them: an embedding and a head)."""
    matrices = [e for e in entries if len(e.shape) == 2]
    suspect = [e for e in matrices if e.algorithm == "normuon" and e.evidence == "name" and e.override is None]
    token = _token_embedding([(e.name, e.tensor) for e in matrices if e.role == "embedding"])
    if token is not None:
        return [e for e in suspect if sorted(e.shape) == sorted(token[1].shape)]
    dims = sorted({d for e in matrices for d in e.shape}, reverse=True)
    if len(matrices) < 3 or len(dims) < 2 or dims[0] < 2 * dims[1]:
        return []
    holders = [e for e in matrices if dims[0] in e.shape]
    return [e for e in suspect if e in holders] if len(holders) <= 2 else []


def high_rank_by_rule(entries):
    """Entries of 3 or more dimensions (two of them above 1: not a vector kept as [1, 1, d]) that went to AdamW
    by the rule for their rank on their names alone (no torch.nn layer, no roles=, no override told what they
    are): a MoE's expert bank [E, m, n] outside an `experts` module is E matrices, a conv kernel or a per-head
    weight is not, and names cannot tell."""
    return [e for e in entries if len(e.shape) >= 3 and sum(d > 1 for d in e.shape) >= 2 and e.override is None
            and e.evidence == "name" and e.algorithm == "adamw" and e.why == f"rule: {len(e.shape)}-D"]


def output_layer_doubts(entries):
    """What to say about the layers the modules routed to NorMuon that may be the output layer
    (_doubt_the_last_layer), unless roles= or overrides= said what they are: one message each."""
    return [e.evidence.message for e in entries
            if isinstance(e.evidence, _Doubt) and e.algorithm == "normuon" and e.override is None]


ROUTING_COLUMNS = ("name", "shape", "dtype", "role", "algorithm", "group", "stats", "why")


def _shape_text(row):
    """"768x3072"; an expert bank as its experts, "8 × 64x32"."""
    shape = row["shape"]
    if row["role"] == "experts" and len(shape) == 3 and row["algorithm"] == "normuon":
        return f"{shape[0]} × {shape[1]}x{shape[2]}"
    return "x".join(map(str, shape)) or "scalar"


def routing_text(label, rows, tail, columns=ROUTING_COLUMNS):
    """A routing table (routing_table()'s rows) as text under a summary line."""
    n_nm = sum(math.prod(r["shape"]) for r in rows if r["algorithm"] == "normuon")
    n_aw = sum(math.prod(r["shape"]) for r in rows if r["algorithm"] == "adamw")
    head = f"{label}: {len(rows)} parameters, {n_nm} values on NorMuon, {n_aw} on AdamW; {tail}"
    cells = [[r[c] if c != "shape" else _shape_text(r) for c in columns] for r in rows]
    widths = [max(len(str(x)) for x in [c] + [row[j] for row in cells]) for j, c in enumerate(columns)]
    lines = [head, "  " + "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  " + "  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)
