"""MegatronNorMuon on Megatron's attention and tensor-parallel metadata (Megatron's TensorParallelMuon
in megatron/core/optimizer/emerging_optimizers.py; contract 9): per-block QKV (split_qkv with is_qkv / qkv_split_shapes), checked block by block against
spec_oracle.normuon_update, and tensor-parallel shards (tensor_model_parallel / partition_dim): run per shard
under tp_mode 'blockwise', refused with the parameter's name under 'duplicated' / 'distributed' (the whole
matrix would need a gather over the TP group, which the adapter does not do)."""
import io
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not importable: the Python tests need it")

from normuon import native  # noqa: E402
import spec_oracle as oracle  # noqa: E402
from normuon.megatron import MegatronNorMuon, init_state_fn  # noqa: E402
from megatron_helpers import set_grads  # noqa: E402


MATMUL_PREC = {"reference": "medium", "fast": "highest"}  # bf16 / fp32 Newton-Schulz
NS_PRECISION = {"reference": "bf16", "fast": "fp32"}
HYPERS = dict(lr=1e-2, weight_decay=0.1, momentum=0.9, beta2=0.95, eps=1e-8)


class FakeGroup:
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


def build(params, backend, **kw):
    kw = dict(dict(coefficient_type="simple", scale_mode="shape_scaling", fp32_matmul_prec=MATMUL_PREC[backend],
                   nesterov=True, **HYPERS), **kw)
    return MegatronNorMuon(params, backend=backend, **kw)


def spec(backend):
    """The spec's values MegatronNorMuon maps HYPERS onto (shape_scaling: no folded constant)."""
    return dict(native.defaults("normuon"), lr=HYPERS["lr"], weight_decay=HYPERS["weight_decay"],
                beta1=HYPERS["momentum"], beta2=HYPERS["beta2"], denom_eps=HYPERS["eps"], nesterov=True,
                ns_coefficients="quintic", ns_precision=NS_PRECISION[backend], reduce_axis="longer_dim",
                lr_scale="official", weight_decay_mode="decoupled", eps_placement="clamp")


def qkv_rows(rows, sizes):
    """Megatron's layout: [query group][q rows | k rows | v rows]; block j = its rows of every group."""
    total = sum(sizes)
    out, offset = [], 0
    for s in sizes:
        out.append([g * total + offset + r for g in range(rows // total) for r in range(s)])
        offset += s
    return [torch.tensor(r) for r in out]


class BlockOracle:
    """The spec applied to each block (and each unsplit matrix) as a matrix of its own."""

    def __init__(self, params, blocks, backend):
        self.h = spec(backend)
        self.p = [p.detach().float().clone() for p in params]
        self.blocks = blocks  # per parameter: None or row-index tensors
        self.M = [torch.zeros(p.shape) for p in params]
        self.v = []
        for p, rows in zip(params, blocks):
            shapes = [p.shape] if rows is None else [(len(r), p.shape[1]) for r in rows]
            self.v.append([torch.zeros(max(m, n)) for m, n in shapes])  # longer_dim statistics

    def step(self, grads):
        for k, grad in enumerate(grads):
            if grad is None:
                continue
            rows = self.blocks[k] if self.blocks[k] is not None else [torch.arange(self.p[k].shape[0])]
            for j, r in enumerate(rows):
                p, g, M = self.p[k][r], grad.float()[r], self.M[k][r]
                oracle.normuon_update(p, g, M, self.v[k][j], self.h, p.shape[0] >= p.shape[1])
                self.p[k][r], self.M[k][r] = p, M


def grads_for(params, step, seed=9):
    g = torch.Generator().manual_seed(seed * 7919 + step)
    return [torch.randn(p.shape, generator=g) * torch.logspace(-1, 1, p.shape[0]).unsqueeze(1) for p in params]


def assert_close(a, b, backend):
    if backend == "reference":
        assert torch.equal(a, b)
    else:  # fp32 Newton-Schulz: oneDNN vs torch.mm GEMMs (test_agreement.py's tolerance)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def qkv_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(24, 8, generator=g).requires_grad_()  # 6 query groups of 2 q, 1 k, 1 v rows
    qkv.is_qkv, qkv.qkv_split_shapes = True, [2, 1, 1]
    gated = torch.randn(20, 6, generator=g).requires_grad_()  # attention_output_gate: q, gate, k, v
    gated.is_qkv = True  # its split shapes come from the optimizer's qkv_split_shapes
    plain = torch.randn(8, 12, generator=g).requires_grad_()
    return [qkv, gated, plain], [qkv_rows(24, [2, 1, 1]), qkv_rows(20, [1, 1, 1, 2]), None]


def test_qkv_blocks_follow_the_spec_block_by_block(backend):
    """split_qkv: Q (12x8, per-row statistics), K and V (6x8 each: wide, per-column statistics) are each
    orthogonalised, normalised and scaled as matrices of their own; the gated weight splits in four; a
    plain matrix next to them is unchanged by the option."""
    params, blocks = qkv_params()
    opt = build([{"params": params}], backend, split_qkv=True, qkv_split_shapes=[1, 1, 1, 2])
    oracle = BlockOracle(params, blocks, backend)
    for t in (1, 2, 3):
        grads = grads_for(params, t)
        set_grads(params, grads)
        opt.step()
        oracle.step(grads)
        for k, p in enumerate(params):
            assert_close(p.detach(), oracle.p[k], backend)
            assert torch.equal(opt.state[p]["momentum_buffer"], oracle.M[k])
    # The blocks' statistics differ from the whole matrix's: the update is not the unsplit one.
    whole = [p.detach().clone().requires_grad_() for p in qkv_params()[0]]
    unsplit = build([{"params": whole}], backend, split_qkv=False)
    for t in (1, 2, 3):
        set_grads(whole, grads_for(whole, t))
        unsplit.step()
    assert not torch.allclose(whole[0], params[0], rtol=0, atol=1e-4)
    assert torch.equal(whole[2], params[2])


def test_qkv_state_is_parameter_shaped_round_trips_and_adopts_edits(backend):
    """A split weight's state: parameter-shaped copies in opt.state (moment2 constant along each block's
    statistics axis), refreshed after every step; edits (in place or by replacement) are read back before
    the next step; save / load into a fresh optimizer resumes bit for bit; the Float16 wrapper's swap
    carries it over."""
    params, blocks = qkv_params(seed=1)
    opt = build([{"params": params}], backend, split_qkv=True, qkv_split_shapes=[1, 1, 1, 2])
    init_state_fn(opt)
    assert all(tuple(opt.state[p]["moment2_buffer"].shape) == tuple(p.shape) for p in params[:2])
    for t in (1, 2):
        set_grads(params, grads_for(params, t))
        opt.step()
    m2 = opt.state[params[0]]["moment2_buffer"]
    q, k = blocks[0][0], blocks[0][1]
    assert torch.equal(m2[q], m2[q][:, :1].expand(-1, 8))   # Q block 12x8: per row
    assert torch.equal(m2[k], m2[k][:1, :].expand(6, -1))   # K block 6x8: per column

    blob = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob)
    fresh, _ = qkv_params(seed=2)
    for p, v in zip(fresh, saved["params"]):
        p.data.copy_(v)
    other = build([{"params": fresh}], backend, split_qkv=True, qkv_split_shapes=[1, 1, 1, 2])
    other.load_state_dict(saved["opt"])
    expected = [None, None]
    for o, ps in ((opt, params), (other, fresh)):
        o.state[ps[0]]["momentum_buffer"].mul_(0.5)  # in place, on the copy
        o.state[ps[1]] = {k: v * 2 for k, v in o.state[ps[1]].items()}  # replaced
        grads = grads_for(ps, 3)
        expected = [oracle.lerp(o.state[p]["momentum_buffer"], g, 1 - HYPERS["momentum"])  # the spec's rounding
                    for p, g in zip(ps[:2], grads)]
        set_grads(ps, grads)
        o.step()
        assert all(torch.equal(o.state[p]["momentum_buffer"], m) for p, m in zip(ps, expected))
    assert all(torch.equal(a, b) for a, b in zip(params, fresh))
    assert all(torch.equal(opt.state[a][k], other.state[b][k]) for a, b in zip(params, fresh)
               for k in ("momentum_buffer", "moment2_buffer"))

    # Float16OptimizerWithFloat16Params: fp32 copies (TP / QKV attributes copied) take over the state.
    oracle_params = [p.detach().clone() for p in params]
    copies = []
    for i, p in enumerate(params):
        c = p.detach().clone()
        for attr in ("is_qkv", "qkv_split_shapes"):
            if hasattr(p, attr):
                setattr(c, attr, getattr(p, attr))
        opt.param_groups[0]["params"][i] = c
        opt.state[c] = opt.state.pop(p)
        copies.append(c)
    for ps, o in ((copies, opt), (fresh, other)):
        set_grads(ps, grads_for(ps, 4))
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(copies, fresh))
    assert not all(torch.equal(a, b) for a, b in zip(copies, oracle_params))

    bad = other.state_dict()
    bad["state"][0]["moment2_buffer"] = bad["state"][0]["moment2_buffer"][:, :1].clone()
    with pytest.raises(ValueError, match=r"moment2_buffer has shape \(24, 1\), expected \(24, 8\) \(the state "
                                         r"of a parameter split into QKV blocks is parameter-shaped\)"):
        other.load_state_dict(bad)


def test_qkv_split_refusals():
    p = torch.zeros(10, 4, requires_grad=True)
    p.is_qkv = True
    kw = dict(coefficient_type="simple", backend="reference", split_qkv=True)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] is a QKV weight and split_qkv is "
                                         r"on, but neither the parameter nor the optimizer has qkv_split_shapes"):
        MegatronNorMuon([p], **kw)
    with pytest.raises(ValueError, match=r"has 10 rows, not a multiple of sum\(qkv_split_shapes\) = 4"):
        MegatronNorMuon([p], qkv_split_shapes=[2, 1, 1], **kw)
    MegatronNorMuon([p], split_qkv=False, coefficient_type="simple", backend="reference")  # whole: fine
    MegatronNorMuon([p], qkv_split_shapes=[3, 1, 1], **kw)  # 2 groups of 5 rows


# ----------------------------------------------------------------------------------- tensor parallelism

def shard(p, dim, tp, rank):
    s = p.detach().chunk(tp, dim=dim)[rank].clone().requires_grad_()
    s.tensor_model_parallel, s.partition_dim = True, dim
    return s


def test_tp_shards_need_blockwise_and_are_refused_by_name_otherwise(backend):
    """With TP > 1 a tensor-parallel shard cannot run 'duplicated' / 'distributed' (the whole matrix is
    on no rank): a ValueError names the parameter and the alternatives. Replicated matrices are fine, and
    expert weights are judged by the expert TP group."""
    full = torch.randn(16, 8)
    column = shard(full, 0, 2, 0)
    replicated = torch.randn(8, 8, requires_grad=True)
    replicated.tensor_model_parallel, replicated.partition_dim = False, -1
    expert = shard(full, 1, 4, 0)
    expert.expert_tp = True
    tp2 = SimpleNamespace(tp=FakeGroup(2), expt_tp=FakeGroup(1))
    for mode in ("duplicated", "distributed"):
        with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] \(local shape \[8, 8\]\) is a "
                                             r"tensor-parallel shard along dim 0 over 2 ranks, and tp_mode="
                                             rf"'{mode}' needs the whole matrix.*tp_mode='blockwise'"):
            build([{"params": [replicated, column]}], backend, pg_collection=tp2, tp_mode=mode)
    build([{"params": [replicated, expert]}], backend, pg_collection=tp2, tp_mode="duplicated")  # expt_tp = 1
    with pytest.raises(ValueError, match=r"along dim 1 over 4 ranks"):
        build([{"params": [expert]}], backend, pg_collection=SimpleNamespace(tp=FakeGroup(1), expt_tp=FakeGroup(4)))
    build([{"params": [column]}], backend, pg_collection=SimpleNamespace(tp=FakeGroup(1), expt_tp=FakeGroup(1)))

    # A shard that arrives later (the Float16 wrapper's fp32 copy keeps the metadata) is refused at the step.
    opt = build([{"params": [replicated]}], backend, pg_collection=tp2, tp_mode="duplicated")
    opt.param_groups[0]["params"] = [column]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(local shape \[8, 8\]\) is a "
                                         "tensor-parallel shard"):
        opt.step()


def test_tp_blockwise_runs_each_shard_as_its_own_matrix(backend):
    """tp_mode='blockwise' (Megatron: Newton-Schulz per local shard, no communication, the result depends on
    the TP size): each rank's shard follows the spec as a standalone matrix, QKV blocks taken inside the
    shard (its own query groups)."""
    tp2 = SimpleNamespace(tp=FakeGroup(2), expt_tp=FakeGroup(2))
    qkv = torch.randn(24, 8)
    local = shard(qkv, 0, 2, 1)  # 3 of the 6 query groups
    local.is_qkv, local.qkv_split_shapes = True, [2, 1, 1]
    row = shard(torch.randn(8, 16), 1, 2, 0)
    params = [local, row]
    opt = build([{"params": params}], backend, pg_collection=tp2, tp_mode="blockwise", split_qkv=True)
    oracle = BlockOracle(params, [qkv_rows(12, [2, 1, 1]), None], backend)
    for t in (1, 2):
        grads = grads_for(params, t)
        set_grads(params, grads)
        opt.step()
        oracle.step(grads)
    for k, p in enumerate(params):
        assert_close(p.detach(), oracle.p[k], backend)


def test_qkv_blocks_are_row_runs_of_the_parameter_itself():
    # Each block is its rows of every query group, read and written where they lie (RowBlock): no index
    # tensors (built on the CPU for a CUDA parameter, they crashed Megatron's first GPU step) and no copy.
    p = torch.nn.Parameter(torch.arange(40.0).reshape(10, 4))
    p.is_qkv = True
    p.qkv_split_shapes = [3, 1, 1]
    fake = SimpleNamespace(split_qkv=True, is_qkv_fn=lambda q: True, qkv_split_shapes=None,
                           _split_shapes=MegatronNorMuon._split_shapes,
                           _fail=lambda msg: pytest.fail(msg))
    blocks = MegatronNorMuon._blocks(fake, p, "qkv")
    assert [b.shape for b in blocks] == [(6, 4), (2, 4), (2, 4)]
    assert [(b.offset, b.runs) for b in blocks] == [(0, (12, 20)), (12, (4, 20)), (16, (4, 20))]
    rows = [[0, 1, 2, 5, 6, 7], [3, 8], [4, 9]]
    for b, r in zip(blocks, rows):
        assert torch.equal(b.values(p.detach()), p.detach()[r])
        assert b.key.data_ptr() == p.data_ptr() + b.offset * 4  # a view of the parameter, not a copy


def split_model(n_layers, seed=0):
    """n_layers of Megatron-like attention weights: a fused QKV (4 query groups of 2 q, 1 k, 1 v rows) and
    an output projection."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(n_layers):
        qkv = torch.randn(16, 8, generator=g).requires_grad_()
        qkv.is_qkv, qkv.qkv_split_shapes = True, [2, 1, 1]
        params += [qkv, torch.randn(8, 8, generator=g).requires_grad_()]
    return params


def split_step_ops(n_layers, dtype):
    from conftest import count_ops
    params = [torch.nn.Parameter(p.detach().to(dtype)) for p in split_model(n_layers)]
    for p, q in zip(params, split_model(n_layers)):
        p.is_qkv, p.qkv_split_shapes = getattr(q, "is_qkv", False), getattr(q, "qkv_split_shapes", None)
    opt = build([{"params": params}], "fast", split_qkv=True)
    set_grads(params, grads_for(params, 1))
    opt.step()  # builds the layout and binds the table
    set_grads(params, grads_for(params, 2))
    addresses = [p.data_ptr() for p in params]
    with count_ops() as count:
        opt.step()
    assert [p.data_ptr() for p in params] == addresses  # stepped where they are
    return count.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_split_qkv_step_dispatches_no_op_per_block(native, dtype):
    """The blocks are stepped in place through row runs: no index_select / index_copy_ per block, no
    parameter-shaped state copies assembled after the step; the op count does not grow with the model."""
    small, large = split_step_ops(1, dtype), split_step_ops(6, dtype)
    assert len(small) == len(large), (small, large)
    assert not [op for op in large if "index" in op or "copy" in op], large


def test_split_state_is_assembled_only_when_looked_at(native):
    """opt.state[p] of a split weight is assembled on first access; once looked at and edited, the edit is
    read back before the next step (as a twin whose blocks' momentum is zeroed directly shows)."""
    params, twin_params = split_model(2), split_model(2)
    opt, twin = (build([{"params": ps}], "fast", split_qkv=True) for ps in (params, twin_params))
    for t in (1, 2):
        for ps, o in ((params, opt), (twin_params, twin)):
            set_grads(ps, grads_for(ps, t))
            o.step()
    state = opt.state[params[0]]
    assert not state.touched  # nobody looked: no copy was made
    momentum = state["momentum_buffer"]
    assert state.touched and tuple(momentum.shape) == (16, 8)
    slot = opt._slots[id(params[0])]
    for block, e in zip(slot.blocks, slot.entries):
        assert torch.equal(block.values(momentum), e.state[0])
    momentum.zero_()  # an edit in place
    for e in twin._slots[id(twin_params[0])].entries:
        e.state[0].zero_()
    for ps, o in ((params, opt), (twin_params, twin)):
        set_grads(ps, grads_for(ps, 3))
        o.step()
    assert not opt.state[params[0]].touched  # a fresh one after the step
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum_buffer"], twin.state[q]["momentum_buffer"])


@pytest.mark.parametrize("how", ["data.copy_", "data =", "no_grad copy_"])
def test_outside_writes_to_a_split_fp32_weight_are_followed(backend, how):
    """Megatron writes its fp32 main parameters through .data (_copy_model_params_to_main_params, loads):
    the next step starts from the written values, on the fast backends (the blocks are read where they
    lie) and on the reference (its working copies are read again every step)."""
    qkv = split_model(1)[0]
    opt = build([{"params": [qkv]}], backend, split_qkv=True)
    qkv.grad = torch.randn(16, 8)
    opt.step()
    new = torch.randn(16, 8)
    if how == "data.copy_":
        qkv.data.copy_(new)
    elif how == "data =":
        qkv.data = new.clone()
    else:
        with torch.no_grad():
            qkv.copy_(new)
    qkv.grad = torch.zeros(16, 8)  # the momentum still moves it: by less than lr per element
    opt.step()
    assert (qkv.detach() - new).abs().max() < 2 * HYPERS["lr"]


def test_split_state_copies_pickles_and_frees_like_a_dict(native):
    import copy
    import gc
    import pickle
    import weakref
    params = split_model(1)
    opt = build([{"params": params}], "fast", split_qkv=True)
    set_grads(params, grads_for(params, 1))
    opt.step()
    state = opt.state[params[0]]
    snapshot = copy.deepcopy(state)  # before anyone looked: still a snapshot of this step's values
    assert isinstance(snapshot, dict) and isinstance(state.copy(), dict) and isinstance(copy.copy(state), dict)
    loaded = pickle.loads(pickle.dumps(state))
    assert type(loaded) is dict and torch.equal(loaded["momentum_buffer"], snapshot["momentum_buffer"])
    set_grads(params, grads_for(params, 2))
    opt.step()
    assert not torch.equal(opt.state[params[0]]["momentum_buffer"], snapshot["momentum_buffer"])
    # No reference cycle through the lazily assembled state: the optimizer goes with its last reference.
    gc.disable()
    try:
        alive = weakref.ref(opt)
        del opt, state
        assert alive() is None
    finally:
        gc.enable()


def test_a_held_split_state_keeps_counting_until_the_next_step(native):
    """A handle to a split weight's (looked-at) state stays the optimizer's through state_dict() and the
    like; its edits are read back at the next step."""
    params, twin_params = split_model(1), split_model(1)
    opt, twin = (build([{"params": ps}], "fast", split_qkv=True) for ps in (params, twin_params))
    for ps, o in ((params, opt), (twin_params, twin)):
        set_grads(ps, grads_for(ps, 1))
        o.step()
    held = opt.state[params[0]]
    held["momentum_buffer"]
    opt.state_dict()  # a checkpoint in between
    held["momentum_buffer"].zero_()
    for e in twin._slots[id(twin_params[0])].entries:
        e.state[0].zero_()
    for ps, o in ((params, opt), (twin_params, twin)):
        set_grads(ps, grads_for(ps, 2))
        o.step()
    assert torch.equal(params[0], twin_params[0])


def test_blocks_routed_to_adamw_are_refused(native):
    import normuon
    from normuon.row_blocks import split_rows
    p = torch.nn.Parameter(torch.randn(8, 4))
    blocks = split_rows(p, [1, 1])
    with pytest.raises(ValueError, match="block of rows .* only a NorMuon group"):
        normuon.NorMuonAdamW([{"params": [b.key for b in blocks], "algorithm": "adamw"}], _row_blocks=blocks)
