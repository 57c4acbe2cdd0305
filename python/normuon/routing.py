"""Roles: which parameters are embeddings and which is the output head (the spec's routing rule reads them,
docs/spec.md section 2). From the model's modules where there is one, from names only as the fallback
(docs/python.md, Routing).

Module evidence (NorMuonAdamW(model) or model=): the weight of an nn.Embedding / nn.EmbeddingBag, or any
tensor tied to one, is an embedding; the head is the layer from the token embedding's width onto its
vocabulary (the token embedding: the largest table not named as positions; a tied head is the embedding and
ends the search), else the module the names call a head.
Name evidence (bare tensors, named_parameters()): wrapper prefixes are stripped first (DDP's module.,
torch.compile's _orig_mod., model., FSDP's and checkpointing's wrappers).
"""
import math
import warnings

import torch

# Leading name components that wrappers add (DDP, torch.compile, Hugging Face, FSDP, activation checkpointing).
WRAPPER_PREFIXES = ("module", "_orig_mod", "model", "base_model", "_fsdp_wrapped_module",
                    "_checkpoint_wrapped_module")
# An embedding: a component containing "embed" (embed_tokens, word_embeddings, tok_embeddings), ending in
# "_emb" (tok_emb, pos_emb, token_emb), or one of these as the tensor or its module (T5's "shared").
EMBEDDING_WORDS = ("wte", "wpe", "emb", "shared")
# A head: the first component (after the prefixes) is one of these...
HEAD_FIRST = ("lm_head", "head", "output", "classifier", "score")
HEAD_ANYWHERE = ("lm_head", "classifier")  # ...or a component anywhere is one of these...
HEAD_PATHS = (("predictions", "decoder"),)  # ...or these components follow each other (BERT's cls.predictions)
EMBEDDING_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def strip_wrappers(name):
    """The name without the leading components wrappers add: 'module._orig_mod.lm_head.weight' -> 'lm_head.weight'."""
    parts = name.split(".")
    while len(parts) > 1 and parts[0] in WRAPPER_PREFIXES:
        parts = parts[1:]
    return ".".join(parts)


def _looks_like_embedding(parts):
    if any("embed" in c for c in parts) or any(c.endswith("_emb") for c in parts):
        return True
    owner_and_leaf = parts[-2:] if parts[-1] in ("weight", "embedding") else parts[-1:]
    return any(c in EMBEDDING_WORDS for c in owner_and_leaf)


def _looks_like_head(parts):
    if parts[0] in HEAD_FIRST or any(c in HEAD_ANYWHERE for c in parts):
        return True
    return any(tuple(parts[i:i + len(p)]) == p for p in HEAD_PATHS for i in range(len(parts)))


def infer_role(name, shape):
    """The manifest role of a parameter from its name and shape alone."""
    parts = strip_wrappers(name.lower()).split(".")
    if _looks_like_embedding(parts):
        return "embedding"
    if _looks_like_head(parts):
        return "head"
    return _shape_role(parts, len(shape))


def _torch_module(module):
    """A module class from torch.nn itself: its parameters' roles follow from the class, not from names."""
    return type(module).__module__.startswith("torch.nn.")


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
    for mname, m in model.named_modules():
        if not _torch_module(m) or isinstance(m, EMBEDDING_MODULES):
            continue
        for pname, p in m.named_parameters(recurse=False):
            if id(p) in roles:
                continue
            full = f"{mname}.{pname}" if mname else pname
            parts = strip_wrappers(full.lower()).split(".")
            if p.dim() == 2 and _looks_like_head(parts):  # no vocabulary to check against: the name decides
                roles[id(p)] = ("head", f"{type(m).__name__} '{mname}', named as a head")
            else:
                roles[id(p)] = (_shape_role(parts, p.dim()), type(m).__name__)
    return roles


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


ROUTING_COLUMNS = ("name", "shape", "dtype", "role", "algorithm", "group", "stats", "why")


def routing_text(label, rows, tail, columns=ROUTING_COLUMNS):
    """A routing table (routing_table()'s rows) as text under a summary line."""
    n_nm = sum(math.prod(r["shape"]) for r in rows if r["algorithm"] == "normuon")
    n_aw = sum(math.prod(r["shape"]) for r in rows if r["algorithm"] == "adamw")
    head = f"{label}: {len(rows)} parameters, {n_nm} values on NorMuon, {n_aw} on AdamW; {tail}"
    cells = [[r[c] if c != "shape" else "x".join(map(str, r["shape"])) or "scalar" for c in columns] for r in rows]
    widths = [max(len(str(x)) for x in [c] + [row[j] for row in cells]) for j, c in enumerate(columns)]
    lines = [head, "  " + "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  " + "  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)
