"""Matrices that lie inside a larger tensor, stepped where they lie as matrices of their own: a block of rows
of a 2-D parameter (RowBlock), or one expert of a mixture-of-experts bank, whole or a block of its rows (Piece).

Megatron's fused QKV weight holds, per query group, the group's query rows, then its key rows, then its value
rows (a gate block too with attention_output_gate). With split_qkv each block (its rows of every query group)
is orthogonalised, normalised and scaled as a matrix of its own. A RowBlock names such a block: `run` rows
taken every `pitch` rows from row `first`. The fast backends read and write it in the parameter and its
gradient through row runs (core/include/normuon/row_runs.h, RowRuns): no copy per step.
"""


class RowBlock:
    """Rows first + g*pitch ... first + g*pitch + run - 1 of every g < rows / pitch, of a 2-D `param`: a
    matrix of shape (rows / pitch * run, cols)."""

    __slots__ = ("param", "first", "run", "pitch", "groups", "cols", "shape", "key")

    def __init__(self, param, first, run, pitch):
        rows, cols = param.shape
        if not (0 <= first and 0 < run and first + run <= pitch and rows % pitch == 0):
            raise ValueError(f"rows {first}..{first + run - 1} of every {pitch} do not fit a parameter of "
                             f"{rows} rows")
        self.param, self.first, self.run, self.pitch = param, first, run, pitch
        self.groups, self.cols = rows // pitch, cols
        self.shape = (self.groups * run, cols)
        # What stands for the block where a tensor is needed (an optimizer's param group, state keys): a
        # view of its rows, made once. The values are always read through view() of the live parameter.
        self.key = self.view(param.detach())

    def view(self, t):
        """The block's rows of `t` (the parameter, its gradient, or a tensor shaped like them) as a
        (groups, run, cols) view: no copy."""
        return t.view(self.groups, self.pitch, self.cols)[:, self.first:self.first + self.run]

    def values(self, t):
        """The block of `t` as a new contiguous (rows, cols) tensor."""
        return self.view(t).reshape(self.shape)

    def write(self, t, values):
        """Writes (rows, cols) `values` into the block's rows of `t`."""
        self.view(t).copy_(values.reshape(self.groups, self.run, self.cols))

    @property
    def param_shape(self):
        """The parameter's shape when the block was made (its geometry)."""
        return self.groups * self.pitch, self.cols

    @property
    def offset(self):
        """Elements from the tensor's first element to the block's."""
        return self.first * self.cols

    @property
    def runs(self):
        """(run, pitch) in elements: row_runs.h's RowRuns."""
        return self.run * self.cols, self.pitch * self.cols

    @property
    def geometry(self):
        """Which matrix of its tensor this is (two layouts over the same tensor compare it)."""
        return self.first, self.run, self.pitch

    suffix = ""  # the Megatron adapter names its blocks itself


class Piece:
    """A dense matrix inside a parameter: expert k of a bank [E, m, n] (transformers 5.x MoE experts, torchtitan's
    GroupedExperts), or, with parts > 1, block `part` of `parts` blocks of consecutive rows of that expert (k
    None: of a 2-D parameter), a fused projection's half (gate_up_proj: the gate's rows, then the up's). The
    layout names it "name[k]" (expert_name in core/include/normuon/manifest.h), with ".partJ" for a block."""

    __slots__ = ("param", "k", "part", "parts", "shape", "param_shape")

    def __init__(self, param, k=None, part=0, parts=1):
        m, n = param.shape[-2:]
        self.param, self.k, self.part, self.parts = param, k, part, parts
        self.shape = (m // parts, n)
        self.param_shape = tuple(param.shape)  # the parameter's shape when the piece was made (its geometry)

    def view(self, t):
        rows = self.shape[0]
        return (t if self.k is None else t[self.k])[self.part * rows:(self.part + 1) * rows]

    def values(self, t):
        return self.view(t).clone()

    def write(self, t, values):
        self.view(t).copy_(values)

    @property
    def offset(self):
        rows, n = self.shape
        return ((self.k or 0) * self.param_shape[-2] + self.part * rows) * n

    runs = (0, 0)  # dense

    @property
    def geometry(self):
        return ("piece", self.k, self.part, self.parts)

    @property
    def suffix(self):
        return ("" if self.k is None else f"[{self.k}]") + (f".part{self.part}" if self.parts > 1 else "")


def pieces(param, parts=1):
    """The Pieces of a bank [E, m, n] (expert by expert) or of a 2-D parameter, each cut into `parts` blocks."""
    ks = [None] if param.dim() == 2 else range(param.shape[0])
    return [Piece(param, k, j, parts) for k in ks for j in range(parts)]


def split_rows(param, sizes):
    """The RowBlocks of a parameter whose row groups are [sizes[0] rows | sizes[1] rows | ...], in order."""
    blocks, first = [], 0
    for size in sizes:
        blocks.append(RowBlock(param, first, size, sum(sizes)))
        first += size
    return blocks

