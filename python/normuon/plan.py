"""Planning: the constructor's input forms (a model, named parameters, tensors, param groups, an explicit
split) turned into param groups of one algorithm each and one entry per parameter, with its role and
route. A pure function of its inputs: the rules it applies (routing, fields) are the core's."""
import warnings

import torch

from .native import _C, fields, require
from .routing import expand_patterns, infer_role, module_roles, router_roles, transposed_weights

NORMUON_FIELDS = fields("normuon") if _C is not None else ()  # the core's fields of a NorMuon group
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")
ADAMW_PREFIXED = tuple("adamw_" + k for k in ADAMW_KEYS)  # AdamW values inside an "auto" group
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def route(name, shape, role, override=None):
    """(algorithm, why): the core's routing rule (manifest.h), or an explicit override; NorMuon on a
    non-2-D tensor is a ValueError."""
    if override not in (None, "auto", "normuon", "adamw"):
        raise ValueError(f"parameter '{name}': unknown algorithm {override!r} (choose auto | normuon | adamw)")
    explicit = override if override in ("normuon", "adamw") else None
    algorithm = require("routing").route(_C.ParamSpec(name, list(shape), "f32", role, "", explicit))
    if explicit:
        return algorithm, "override"
    if algorithm == "normuon":
        return algorithm, "rule: expert bank" if len(shape) == 3 else "rule: 2-D matrix"
    if role in ("embedding", "head", "router") or role == "bias" and len(shape) >= 2:  # (biases: at any rank)
        return algorithm, f"rule: {role}"
    return algorithm, f"rule: {len(shape)}-D"


class _Entry:
    """One parameter: the user's tensor, its state (views of the optimizer's buffers) and, when it is
    bf16/fp16, its fp32 master."""

    __slots__ = ("index", "name", "tensor", "shape", "dtype", "role", "evidence", "algorithm", "why", "group",
                 "override", "master", "state", "stats_per_row", "stat_len", "block", "grad_of", "parts", "transposed",
                 "order", "staged")

    @property
    def low_precision(self):
        return self.dtype != torch.float32

    @property
    def frozen(self):
        """requires_grad=False and no gradient: one process leaves it out of its layout (no state) until it has one."""
        return not self.tensor.requires_grad and self.tensor.grad is None

    @property
    def source(self):
        """The tensor that holds the values: the parameter, or the one a block of rows lies in (RowBlock)."""
        return self.tensor if self.block is None else self.block.param

    @property
    def param(self):
        """The fp32 values a step reads and writes: the parameter itself, or the master of a bf16/fp16 one."""
        return self.master if self.master is not None else self.tensor.detach()

    def values(self):
        """The parameter's values as they are now, shape self.shape (a block's: a copy)."""
        t = self.source.detach()
        return t if self.block is None else self.block.values(t)

    def write(self, values):
        """Writes `values` (self.shape) into the parameter, rounded to its dtype."""
        if self.block is None:
            self.tensor.detach().copy_(values)
        else:
            self.block.write(self.block.param.detach(), values)


def plan_groups(params, normuon_defaults, adamw_defaults, overrides, roles, row_blocks=None, split_rows=None,
                transposed=None):
    """User input -> (param groups of one algorithm each, entries in manifest order): every input form,
    roles and routing, and nothing else (no state, no native buffers). roles: {name: role or (role,
    evidence)} (resolve_inputs); a parameter without one is judged by its name (routing.py). row_blocks:
    {id(key tensor): RowBlock} of the Megatron adapter's split matrices. split_rows: {name: parts}, matrices (or
    each expert of a bank) stepped as `parts` blocks of consecutive rows. transposed: {name: (bool, evidence)}
    (resolve_inputs), matrices stored [in, out]. Consumes overrides, roles, split_rows, transposed."""
    split_rows = {} if split_rows is None else split_rows
    transposed = {} if transposed is None else transposed
    params = list(params)
    if not params:
        raise ValueError("NorMuonAdamW got an empty parameter list")
    if isinstance(params[0], dict):
        user_groups, named = params, False
    else:
        user_groups, named = [{"params": params}], True
    unnamed = []  # auto-routed matrices with neither a name nor a module to tell their role
    entries, groups, seen_names, seen_tensors = [], [], set(), set()
    for gi, ug in enumerate(user_groups):
        if not isinstance(ug, dict) or "params" not in ug:
            raise ValueError(f"param group #{gi} is not a dict with 'params'")
        algorithm = ug.get("algorithm", "auto")
        if algorithm not in ("auto", "normuon", "adamw"):
            raise ValueError(f"param group #{gi}: algorithm={algorithm!r} (choose auto | normuon | adamw)")
        allowed = {"params", "names", "param_names", "name", "algorithm"}
        if algorithm == "adamw":
            allowed |= set(ADAMW_KEYS)
        else:
            allowed |= set(NORMUON_FIELDS) | {"momentum", "betas"}
        if algorithm == "auto":
            allowed |= set(ADAMW_PREFIXED)
        unknown = sorted(set(ug) - allowed)
        if unknown:
            raise ValueError(f"param group #{gi} ({algorithm}): unknown key(s) {', '.join(unknown)} "
                             f"(allowed: {', '.join(sorted(allowed))})")
        pairs = _named_tensors(ug["params"], group_names_of(ug), gi, "param" if named else f"group{gi}.")
        # Hyper-parameters of this user group, per algorithm.
        nm = dict(normuon_defaults)
        aw = dict(adamw_defaults)
        if algorithm == "adamw":
            aw.update({k: ug[k] for k in ADAMW_KEYS if k in ug})
        else:
            nm.update({k: ug[k] for k in NORMUON_FIELDS if k in ug})
            if "momentum" in ug:
                nm["beta1"] = ug["momentum"]
            if "betas" in ug:  # the pair itself; beta1 / beta2 given beside it must agree with it
                nm["betas"] = ug["betas"]
                if not any(k in ug for k in ("beta1", "beta2", "momentum")):
                    nm.pop("beta1"), nm.pop("beta2")
            aw.update({k[len("adamw_"):]: ug[k] for k in ADAMW_PREFIXED if k in ug})
        if not isinstance(aw["betas"], (tuple, list)) or len(aw["betas"]) != 2:
            raise ValueError(f"param group #{gi}: AdamW's betas={aw['betas']!r} is not a pair")
        aw["betas"] = tuple(aw["betas"])
        base = ug.get("name", None if named else f"group{gi}")
        if named:  # the default groups of the C++ options: a CLI-made state file fits
            names = {"normuon": "normuon", "adamw": "adamw"}
        elif algorithm == "auto":
            names = {"normuon": f"{base}_normuon", "adamw": f"{base}_adamw"}
        else:
            names = {algorithm: base}
        try:
            _normuon_betas(nm, None)  # both forms of NorMuon's pair, as the schedulers expect
        except ValueError as error:
            raise ValueError(f"param group #{gi}: {error}") from None
        sub = {alg: {"params": [], "param_names": [], "name": n, "algorithm": alg,
                     **(nm if alg == "normuon" else aw)} for alg, n in names.items()}
        in_group = set()
        for name, tensor, given in pairs:
            if id(tensor) in in_group:  # torch warns and steps it twice; here it is refused
                raise ValueError(f"param group #{gi} is a parameter group with duplicate parameters: '{name}' is "
                                 "there twice (it would be stepped twice)")
            if id(tensor) in seen_tensors:
                raise ValueError(f"some parameters appear in more than one parameter group: '{name}'")
            in_group.add(id(tensor))
            if name in seen_names:
                raise ValueError(f"two parameters are named '{name}'")
            seen_names.add(name)
            seen_tensors.add(id(tensor))
            told = roles.pop(name, (None, "name"))
            role, evidence = told if isinstance(told, tuple) else (told, "roles=")
            e = _make_entry(len(entries), name, tensor, role, (row_blocks or {}).get(id(tensor)))
            e.evidence = evidence
            explicit = overrides.pop(name, None)
            override = explicit
            if algorithm != "auto":  # the group's algorithm is an override of all its parameters
                if explicit not in (None, "auto", algorithm):
                    raise ValueError(f"parameter '{name}' is overridden to {explicit} but sits in the "
                                     f"{algorithm} group '{base}'")
                override = algorithm
            e.override = override if override in ("normuon", "adamw") else None
            e.algorithm, e.why = route(name, e.shape, e.role, override)
            if is_bank(e) and e.shape[0] == 0:
                raise ValueError(f"parameter '{name}' is an expert bank without experts (shape {list(e.shape)})")
            if e.block is not None and e.algorithm != "normuon":
                raise ValueError(f"parameter '{name}' is a block of rows of a larger tensor, which only a "
                                 f"NorMuon group may hold (it went to {e.algorithm}: {e.why})")
            if algorithm != "auto" and explicit not in ("normuon", "adamw"):
                e.why = f"group '{base}'"
            elif e.why.startswith("rule: ") and e.role in ("embedding", "head", "router", "experts"):
                e.why += f" ({evidence})"  # what told the role: a module, the name, or roles=
            _transpose(e, *transposed.pop(name, (False, None)))
            if name in split_rows:
                _split(e, split_rows.pop(name))
            if given is not True and evidence == "name" and e.algorithm == "normuon" and override is None:
                unnamed.append(name)
            sub[e.algorithm]["params"].append(tensor)
            sub[e.algorithm]["param_names"].append(name)
            entries.append(e)
        for alg, g in sub.items():
            if not pairs or not all(given is not False for _, _, given in pairs):  # torch's key: named ones
                del g["param_names"]
            if algorithm != "auto" or g["params"]:  # drop the empty half of a split group
                groups.append(g)
    if unnamed:
        warnings.warn(f"NorMuonAdamW got matrices without names ({', '.join(unnamed[:4])}"
                      f"{', ...' if len(unnamed) > 4 else ''}), so it cannot tell embeddings and the output head "
                      "from hidden matrices: every 2-D tensor goes to NorMuon. Pass the model "
                      "(NorMuonAdamW(model) or model=model), model.named_parameters(), normuon_params= / "
                      "adamw_params=, or roles/overrides by these names", stacklevel=3)
    if overrides:
        raise ValueError(f"overrides name unknown parameter(s): {', '.join(sorted(overrides))}")
    if roles:
        raise ValueError(f"roles name unknown parameter(s): {', '.join(sorted(roles))}")
    if split_rows:
        raise ValueError(f"split_rows names unknown parameter(s): {', '.join(sorted(split_rows))}")
    if transposed:
        raise ValueError(f"transposed names unknown parameter(s): {', '.join(sorted(transposed))}")
    if any("param_names" in g for g in groups):  # an empty group says nothing: named as the others are
        for g in groups:
            if not g["params"]:
                g.setdefault("param_names", [])
    group_names = [g["name"] for g in groups]
    for n in group_names:
        if not isinstance(n, str) or not n or "." in n or "=" in n or group_names.count(n) > 1:
            raise ValueError(f"group name {n!r} must be a unique non-empty string without '.' or '='")
    by_tensor = {id(e.tensor): e for e in entries}
    for gi, g in enumerate(groups):
        g["step"] = 0
        for t in g["params"]:
            by_tensor[id(t)].group = gi
    return groups, entries



def is_bank(e):
    """A planned expert bank that NorMuon steps as its experts."""
    return e.role == "experts" and e.algorithm == "normuon" and len(e.shape) == 3 and e.block is None


def _transpose(e, flag, evidence):
    """e stored [in, out] when flag: NorMuon's statistics and shape factor follow its columns (the module's rows).
    Only NorMuon's matrices and banks have those; the modules' word is taken where it applies, transposed= is
    refused where it cannot."""
    if not isinstance(flag, bool):
        raise ValueError(f"transposed: parameter '{e.name}': {flag!r} is not True or False")
    if flag and not require("routing").transposable(_C.ParamSpec(e.name, list(e.shape), "f32", e.role)):
        if evidence == "transposed=":
            raise ValueError(f"transposed: parameter '{e.name}' {list(e.shape)} is not a matrix or an expert bank")
        flag = False
    e.transposed = flag and e.algorithm == "normuon"
    if e.transposed:
        e.why += f" (stored [in, out]: {evidence})"


def _split(e, parts):
    """e stepped as `parts` blocks of consecutive rows (each expert of a bank): a fused projection's halves."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"split_rows: parameter '{e.name}': {parts!r} is not a number of blocks (an int >= 1)")
    if e.algorithm != "normuon" or e.block is not None or len(e.shape) != (3 if e.role == "experts" else 2):
        raise ValueError(f"split_rows: parameter '{e.name}' {list(e.shape)} is not a matrix or an expert bank NorMuon "
                         f"steps ({e.algorithm}: {e.why})")
    if e.transposed and parts > 1:
        raise ValueError(f"split_rows: parameter '{e.name}' is stored [in, out] ({e.why}): its outputs are its "
                         "columns, and splitting columns is not served (its rows are input features)")
    if e.shape[-2] % parts:
        raise ValueError(f"split_rows: parameter '{e.name}' has {e.shape[-2]} rows, not a multiple of {parts}")
    e.parts = parts
    if parts > 1:
        e.why += f" (split into {parts} blocks of rows)"


def _normuon_betas(group, seen):
    """A NorMuon group keeps its pair as beta1 and beta2 (the spec's names) and as betas (what torch's
    schedulers cycle). Whichever form changed since `seen` (the pair last read) wins; both changed and
    different is a ValueError. Writes both forms back."""
    pair = (group.get("beta1"), group.get("beta2"))
    betas = group.get("betas")
    if betas is not None:
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas={betas!r} is not a pair")
        betas = tuple(betas)
    if betas is None or betas == pair:
        resolved = pair
    elif None in pair or (seen is not None and pair == tuple(seen)):
        resolved = betas  # given as betas, or a scheduler moved betas
    elif seen is not None and betas == tuple(seen):
        resolved = pair  # beta1 / beta2 were set
    else:
        raise ValueError(f"betas={betas!r} and beta1={pair[0]!r}, beta2={pair[1]!r} disagree (betas is "
                         "(beta1, beta2) for torch's schedulers: set one form)")
    group["beta1"], group["beta2"] = resolved
    group["betas"] = resolved
    return resolved




_UNORDERED = ("optimizer parameters need to be organized in ordered collections, but the ordering of tensors in "
              "sets will change between runs. Please use a list instead.")  # torch's words


def _is_pair(x):
    """A (name, tensor) pair, as named_parameters() gives them."""
    return isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[0], str)


def group_names_of(group):
    """The names a param group dict gives its parameters: "param_names" (torch's key), or "names" (this package's
    earlier key, still read); None when it gives none."""
    names = group.get("param_names", group.get("names"))
    if "param_names" in group and "names" in group and list(group["names"]) != list(names):
        raise ValueError("a param group gives both 'param_names' and 'names', and they differ")
    return names


def check_naming(params):
    """torch.optim's rule: every parameter named (a (name, tensor) pair, or a group with param_names) or none, in
    a group and over the groups; ValueError with torch's words otherwise. params: a list (of tensors, pairs or
    group dicts)."""
    def named(items, group):
        if isinstance(group, dict) and group_names_of(group) is not None:
            return True
        kinds = {_is_pair(x) for x in items}
        if len(kinds) > 1:
            raise ValueError("all optimizer params should be with/without names. Some param names are missing")
        return kinds.pop() if kinds else None  # None: an empty group says nothing

    if params and isinstance(params[0], dict):
        kinds = [named([g["params"]] if isinstance(g.get("params"), torch.Tensor) else list(g.get("params", ())), g)
                 for g in params if isinstance(g, dict)]
        kinds = [k for k in kinds if k is not None]
        odd = next((k for k in kinds if k != kinds[0]), None)
        if odd is not None:  # torch's words: the first group that differs from the first one
            raise ValueError("all optimizer param groups should be with/without names. cannot add param group "
                             f"{'with' if odd else 'without'} names to the optimizer")
    else:
        named(params, None)


def _named_tensors(params, names, group_index, prefix):
    """(name, tensor, given) triples from tensors (named prefix + position), (name, tensor) pairs, or tensors
    with a parallel names list; given: True where the caller (or the model) named it, "generated" for a name
    made for a tensor beside named ones (_name_the_rest), False for a bare tensor."""
    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    if names is not None:
        names = list(names)
        if len(names) != len(params):
            raise ValueError(f"param group #{group_index}: {len(names)} names for {len(params)} parameters")
        params = list(zip(names, params))
    triples = []
    for k, p in enumerate(params):
        if _is_pair(p):
            (name, tensor), given = p, "generated" if isinstance(p[0], _Generated) else True
            name = str(name)  # (a plain str: state dicts load with weights_only)
        else:
            name, tensor, given = f"{prefix}{k}", p, False
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"parameter '{name}' is a {type(tensor).__name__}, not a torch.Tensor")
        triples.append((name, tensor, given))
    return triples


def resolve_inputs(params, normuon_params=None, adamw_params=None, model=None, roles=None, transposed=None):
    """(params, roles, transposed) from the constructor's forms: an nn.Module (routed by its modules),
    parameters or groups (model= adds the modules' evidence and names the bare tensors of the model), or an
    explicit split into normuon_params / adamw_params (as Muon users split by hand). roles: {name: role} from
    roles= (which wins) and {name: (role, evidence)} from the modules. transposed: {name: (bool, evidence)}, the
    matrices stored [in, out], from the modules (Conv1D) and transposed= (names or patterns: bool, which wins)."""
    if isinstance(params, torch.nn.Module):
        if model is not None and model is not params:
            raise ValueError("NorMuonAdamW got a module as params and another one as model=")
        model, params = params, list(params.named_parameters())
    if isinstance(params, torch.Tensor):  # iterating it would make each row a parameter
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
                        f"{torch.typename(params)} (pass [tensor] for a single parameter)")
    if isinstance(params, (set, frozenset)):
        raise TypeError(_UNORDERED)
    if isinstance(params, dict):
        raise TypeError("params is a dict: pass a param group as [{'params': ...}], a list of groups")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model= must be a torch.nn.Module, not {type(model).__name__}")
    name_all = model is not None  # a module names the tensors: any it does not know get generated names
    if normuon_params is None and adamw_params is None:
        if params is None:
            raise TypeError("NorMuonAdamW needs params (a model, its named_parameters() or param groups) or "
                            "normuon_params= / adamw_params=")
    elif params is not None:
        raise ValueError("NorMuonAdamW: pass either params or normuon_params= / adamw_params=, not both")
    else:
        params = []
        for name, given in (("normuon", normuon_params), ("adamw", adamw_params)):
            if isinstance(given, torch.nn.Module):
                given = list(given.named_parameters())
                name_all = True
            given = [] if given is None else [given] if isinstance(given, torch.Tensor) else list(given)
            if given:
                params.append({"params": given, "algorithm": name, "name": name})
    params = [_listed(item) for item in params]  # walked more than once below: generators (named_parameters(),
    # a group's parameters()) as lists
    told, flips = {}, {}
    if model is not None:
        by_module, stored_in_out = module_roles(model), transposed_weights(model)
        params = _named_by(params, {id(p): n for n, p in model.named_parameters()})
        told = {n: by_module[id(t)] for n, t in _pairs(params) if id(t) in by_module}
        flips = {n: (True, stored_in_out[id(t)]) for n, t in _pairs(params) if id(t) in stored_in_out}
    if name_all:
        params = _name_the_rest(params)
    check_naming(params)  # (the model's names count: they are not missing)
    names = param_names(params)
    told.update(router_roles(names))  # a router's Linear is a matrix to its module, a router by what lies beside it
    told.update(expand_patterns(roles or {}, names, "roles"))
    flips.update({n: (v, "transposed=") for n, v in expand_patterns(transposed or {}, names, "transposed").items()})
    return params, told, flips


class _Generated(str):
    """A name made for a bare tensor (param<k>, group<g>.<k>), not the caller's."""


def _name_the_rest(params):
    """params with every bare tensor named as plan_groups would name it (param<k> in a flat list, group<g>.<k>
    in groups): where a module names the others, the caller chose no partial naming."""
    if params and isinstance(params[0], dict):
        out = []
        for gi, g in enumerate(params):
            ps = g.get("params", [])
            if isinstance(g, dict) and group_names_of(g) is None and not isinstance(ps, torch.Tensor):
                g = dict(g, params=[(_Generated(f"group{gi}.{k}"), p) if isinstance(p, torch.Tensor) else p
                                    for k, p in enumerate(ps)])
            out.append(g)
        return out
    return [(_Generated(f"param{k}"), p) if isinstance(p, torch.Tensor) else p for k, p in enumerate(params)]


def _listed(item):
    """A param group with its "params" as a list (a generator is walked once only); anything else as it is."""
    if isinstance(item, dict) and "params" in item and not isinstance(item["params"], torch.Tensor):
        if isinstance(item["params"], (set, frozenset)):
            raise TypeError(_UNORDERED)
        return dict(item, params=list(item["params"]))
    return item


def param_names(params):
    """The names that params gives its tensors (bare tensors have none yet), in order."""
    return [n for n, _ in _pairs(params)]


def _pairs(params):
    """Every (name, tensor) that params names, in groups or not."""
    for item in params:
        if isinstance(item, dict) and "params" in item:
            ps = item["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            if group_names_of(item) is not None:
                yield from zip(group_names_of(item), ps)
            else:
                yield from (x for x in ps if _is_pair(x))
        elif _is_pair(item):
            yield item


def _named_by(params, names):
    """params with each bare tensor that `names` knows (by identity) as a (name, tensor) pair."""
    def name(x):
        return (names[id(x)], x) if isinstance(x, torch.Tensor) and id(x) in names else x

    params = [params] if isinstance(params, torch.Tensor) else list(params)
    out = []
    for item in params:
        if isinstance(item, dict) and "params" in item:
            ps = item["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)  # walked again: no generators
            item = dict(item, params=ps if group_names_of(item) is not None else [name(x) for x in ps])
        elif not isinstance(item, dict):
            item = name(item)
        out.append(item)
    return out


def _make_entry(index, name, tensor, role, block=None):
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates (os.fsdecode of a bad byte): the C++ manifest needs UTF-8
        raise ValueError(f"parameter name {name!r} is not valid UTF-8 (the manifest and state files store names "
                         "as UTF-8): rename it") from None
    if tensor.dtype not in DTYPES:
        raise ValueError(f"parameter '{name}' is {tensor.dtype}; NorMuonAdamW takes float32, bfloat16 or float16")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"parameter '{name}' is on {tensor.device}; NorMuonAdamW runs on CPU or CUDA tensors")
    if tensor.is_sparse:
        raise ValueError(f"parameter '{name}' is sparse")
    e = _Entry()
    e.index, e.name, e.tensor, e.block = index, name, tensor, block
    e.shape, e.dtype = tuple(tensor.shape) if block is None else block.shape, tensor.dtype
    e.role = role if role is not None else infer_role(name, e.shape)
    if e.role not in ("matrix", "embedding", "head", "norm", "bias", "other", "router", "experts"):
        raise ValueError(f"parameter '{name}': unknown role {e.role!r} (matrix | embedding | head | norm | bias | "
                         "other | router | experts)")
    e.grad_of = None  # a sharded parameter's DTensor, whose .grad holds this entry's gradient (sharded.py)
    e.parts = 1  # blocks of rows the matrix (each expert of a bank) is stepped as (split_rows=)
    e.stats_per_row, e.stat_len = True, 0
    e.transposed = False  # stored [in, out] (plan_groups' transposed)
    e.order = None  # engine entries: a dense tensor's dimensions in memory order, when not row-major (engine.py)
    e.staged = False  # engine entries: stepped through a contiguous copy (a tensor neither contiguous nor dense)
    return e
