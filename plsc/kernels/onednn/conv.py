"""oneDNN convolutions on float32 memory: forward, data gradient, weight gradient.

Paddle 3.3's CPU `conv2d` and its gradients lower to im2col and a GEMM; oneDNN (the library
torch's CPU convolutions run on too) has direct kernels for blocked layouts. The forward
chooses its layouts and the gradients take the same activation layouts (`_gradient_pd`); a
plain input is reordered into them and a result back, both by oneDNN, and the weight gradient
reads the output gradient the data gradient already reordered. An input or output given in
the blocked layout itself (`blocked_in` / `blocked_out`: a backbone that keeps its activations
blocked, `plsc.models.blocked`) is read and written where it is, with no reorder. That layout's
block (`block`: nChw16c where oneDNN's convolutions run AVX-512 kernels, nChw8c under AVX2) is
the one oneDNN itself chooses for a convolution's output, asked once a process.

One `_Plan` per convolution geometry (shapes, stride, padding, dilation, groups, bias; layouts
and block) holds the primitives and their reorders; plans are built on first use and kept for
the process. The blocked copies live in scratch buffers all plans share (`library.SCRATCH`,
four slots grown to the largest geometry's sizes), only for the duration of a call. oneDNN
runs on the OpenMP threads Paddle runs on. The layer that chooses between this and Paddle's
`conv2d` is `plsc.models.conv.Conv2D`.
"""
import ctypes

from .library import (ARG_BIAS, ARG_DIFF_BIAS, ARG_DIFF_DST, ARG_DIFF_SRC, ARG_DIFF_WEIGHTS,
                      ARG_DST, ARG_SRC, ARG_WEIGHTS, CONVOLUTION_DIRECT, FORWARD_TRAINING,
                      QUERY_DIFF_DST, QUERY_DIFF_SRC, QUERY_DIFF_WEIGHTS, QUERY_DST, QUERY_SRC,
                      QUERY_WEIGHTS, SCRATCH, TAG_A, TAG_ABCD, TAG_ABCD8B, TAG_ABCD16B, TAG_ABCDE,
                      TAG_ANY, Arg, available,
                      dims, engine, execute, lib, md, memory, ok, primitive, set_handle, vp)

__all__ = ["plan", "plan_count", "scratch_bytes", "release_scratch", "samples_per_call",
           "conv_forward", "conv_backward", "blocked_native", "block", "blocked_tag",
           "force_block", "CALL_BYTES"]

_TAGS = {16: TAG_ABCD16B, 8: TAG_ABCD8B}  # channels a block holds: the layout's oneDNN tag

_plans = {}
# The shared scratch slot (`library.SCRATCH`) of each argument. No primitive has two arguments
# in one slot, and the one thing a call carries from one primitive to the next, the output
# gradient the data gradient staged ("b") for the weight gradient, is in a slot the weight
# gradient does not write; the data gradient's result ("a") is copied out before the weight
# gradient stages its input there.
CALL_BYTES = 64 << 20  # a staged activation of one call (a piece of the batch), at least
_SLOTS = {"src": "a", "diff_src": "a", "dst": "b", "diff_dst": "b", "weights": "w",
          "diff_weights": "dw"}


class _Plan:
    """The primitives of one convolution geometry: forward, then (on first use) the gradients."""

    def __init__(self, x_shape, w_shape, stride, pad_l, pad_r, dilation, groups, bias,
                 blocked_in=False, blocked_out=False, block_size=16):
        n, c, h, w = x_shape
        o, _, kh, kw = w_shape
        oh = (h + pad_l[0] + pad_r[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
        ow = (w + pad_l[1] + pad_r[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
        self.out_shape = (n, o, oh, ow)
        self.bias = bias
        if groups == 1:
            w_dims, w_tag = w_shape, TAG_ABCD
        else:
            w_dims, w_tag = (groups, o // groups) + tuple(w_shape[1:]), TAG_ABCDE
        self.geometry = (dims(stride), dims([d - 1 for d in dilation]), dims(pad_l),
                         dims(pad_r))
        # the layouts the tensors hold ("plain" unless given blocked) and the ones oneDNN may
        # choose from ("any", or the blocked layout given)
        src_tag, dst_tag = (blocked_tag(block_size) if b else TAG_ABCD
                            for b in (blocked_in, blocked_out))
        self.plain = {"src": md(x_shape, src_tag), "weights": md(w_dims, w_tag),
                      "dst": md(self.out_shape, dst_tag)}
        self.any = {"src": self.plain["src"] if blocked_in else md(x_shape, TAG_ANY),
                    "weights": md(w_dims, TAG_ANY),
                    "dst": self.plain["dst"] if blocked_out else md(self.out_shape, TAG_ANY)}
        self.bias_md = md((o,), TAG_A) if bias else None
        self.fwd_pd = vp()
        ok(lib().dnnl_convolution_forward_primitive_desc_create(
            ctypes.byref(self.fwd_pd), engine(), FORWARD_TRAINING, CONVOLUTION_DIRECT,
            self.any["src"], self.any["weights"], self.bias_md, self.any["dst"],
            *self.geometry, None), "convolution_forward_primitive_desc_create")
        self.fwd = primitive(self.fwd_pd)
        self.fwd_args = self._args(self.fwd_pd, {"src": (QUERY_SRC, True),
                                                 "weights": (QUERY_WEIGHTS, True),
                                                 "dst": (QUERY_DST, False)})
        self.bias_memory = memory(self.bias_md) if bias else None
        self.bwd_data = None
        self.bwd_weights = None

    def _args(self, pd, roles):
        """{role: Arg} for (query, is an input) by role name ("diff_" roles use the plain
        layout of the role they are the gradient of; `_SLOTS` their scratch buffer)."""
        args = {}
        for role, (query, is_input) in roles.items():
            wanted = lib().dnnl_primitive_desc_query_md(pd, query, 0)
            args[role] = Arg(self.plain[role.replace("diff_", "")], wanted, is_input,
                             _SLOTS[role])
        return args

    def _gradient_pd(self, create, *weights_bias):
        """The primitive descriptor of a gradient (`create`: oneDNN's backward data or weights
        constructor) with the activations in the layouts the forward chose, so that no
        strided data gradient falls to a channels-last kernel and the reorders into and out of
        it (IResNet50's eight strided data gradients at batch 32, one thread: 339 against
        399 ms with the reorders). Where no kernel takes those layouts, oneDNN chooses ("any")."""
        forward = (self.fwd_args["src"].wanted, self.fwd_args["dst"].wanted)
        for last, (src, dst) in enumerate((forward, (self.any["src"], self.any["dst"]))):
            pd = vp()
            status = create(ctypes.byref(pd), engine(), CONVOLUTION_DIRECT, src,
                            *weights_bias, dst, *self.geometry, self.fwd_pd, None)
            if status == 0 or last:
                ok(status, "convolution_backward_primitive_desc_create")
                return pd

    def _backward_data(self):
        if self.bwd_data is None:
            pd = self._gradient_pd(lib().dnnl_convolution_backward_data_primitive_desc_create,
                                   self.any["weights"])
            self.bwd_data = (primitive(pd), self._args(pd, {
                "diff_src": (QUERY_DIFF_SRC, False), "weights": (QUERY_WEIGHTS, True),
                "diff_dst": (QUERY_DIFF_DST, True)}))
        return self.bwd_data

    def _backward_weights(self):
        if self.bwd_weights is None:
            pd = self._gradient_pd(
                lib().dnnl_convolution_backward_weights_primitive_desc_create,
                self.any["weights"], self.bias_md)
            self.bwd_weights = (primitive(pd), self._args(pd, {
                "src": (QUERY_SRC, True), "diff_weights": (QUERY_DIFF_WEIGHTS, False),
                "diff_dst": (QUERY_DIFF_DST, True)}))
        return self.bwd_weights

    def forward(self, x_ptr, w_ptr, b_ptr, y_ptr):
        args = self.fwd_args
        args["src"].stage_in(x_ptr)
        args["weights"].stage_in(w_ptr)
        args["dst"].bind_out(y_ptr)
        run = [(ARG_SRC, args["src"].memory), (ARG_WEIGHTS, args["weights"].memory),
               (ARG_DST, args["dst"].memory)]
        if self.bias:
            set_handle(self.bias_memory, b_ptr)
            run.append((ARG_BIAS, self.bias_memory))
        execute(self.fwd, run)
        args["dst"].stage_out(y_ptr)

    def backward(self, x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, db_ptr):
        """The gradients asked for (a None pointer skips that one)."""
        dy_staged = None
        if dx_ptr is not None:
            prim, args = self._backward_data()
            args["weights"].stage_in(w_ptr)
            args["diff_dst"].stage_in(dy_ptr)
            args["diff_src"].bind_out(dx_ptr)
            execute(prim, [(ARG_WEIGHTS, args["weights"].memory),
                            (ARG_DIFF_DST, args["diff_dst"].memory),
                            (ARG_DIFF_SRC, args["diff_src"].memory)])
            args["diff_src"].stage_out(dx_ptr)
            dy_staged = args["diff_dst"]
        if dw_ptr is not None:
            prim, args = self._backward_weights()
            args["src"].stage_in(x_ptr)
            args["diff_dst"].stage_in(dy_ptr, staged_by=dy_staged)
            args["diff_weights"].bind_out(dw_ptr)
            run = [(ARG_SRC, args["src"].memory), (ARG_DIFF_DST, args["diff_dst"].memory),
                   (ARG_DIFF_WEIGHTS, args["diff_weights"].memory)]
            if self.bias:
                set_handle(self.bias_memory, db_ptr)
                run.append((ARG_DIFF_BIAS, self.bias_memory))
            execute(prim, run)
            args["diff_weights"].stage_out(dw_ptr)


def plan(x_shape, w_shape, stride, pad_l, pad_r, dilation, groups, bias, blocked_in=False,
         blocked_out=False):
    """The `_Plan` of this geometry and layout (built on first use; the library must be
    `available`). `x_shape` is the logical NCHW shape whatever the layout; a blocked one is in
    blocks of `block()` channels."""
    key = (tuple(x_shape), tuple(w_shape), tuple(stride), tuple(pad_l), tuple(pad_r),
           tuple(dilation), int(groups), bool(bias), bool(blocked_in), bool(blocked_out),
           block() if blocked_in or blocked_out else 0)
    found = _plans.get(key)
    if found is None:
        found = _plans[key] = _Plan(*key)
    return found


_native = []  # (block, blocked_native) once a process


def _native_layout():
    if not _native:
        _native.append((16, False))
        if available():  # ask a 16-to-16-channel 3x3 convolution (not kept among the plans)
            p = _Plan((2, 16, 8, 8), (16, 16, 3, 3), (1, 1), (1, 1), (1, 1), (1, 1), 1, False)
            for size, tag in _TAGS.items():
                if lib().dnnl_memory_desc_equal(p.fwd_args["dst"].wanted, md(p.out_shape, tag)):
                    _native[0] = (size, True)
    return _native[0]


def block():
    """Channels a block of the blocked layout holds: those of the layout oneDNN, left to
    choose, gives a convolution's output (16 where its kernels are AVX-512, 8 under AVX2:
    `ONEDNN_MAX_CPU_ISA=AVX2` or an AVX2 CPU), 16 where it chooses neither. Asked once a
    process (`force_block` overrides it)."""
    return _native_layout()[0]


def blocked_native():
    """True when oneDNN, left to choose, puts a convolution's output in a blocked layout
    (nChw16c or nChw8c: `block`), so that keeping activations in it costs no kernel speed."""
    return _native_layout()[1]


def blocked_tag(size):
    """oneDNN's format tag of the blocked layout in blocks of `size` channels (aBcd16b, aBcd8b)."""
    return _TAGS[size]


def force_block(size):
    """Make `block` `size` (8 or 16) and `blocked_native` true for this process, or with None
    ask oneDNN again (tests: the other block's paths on this CPU). Plans are kept per block."""
    if size is not None and size not in _TAGS:
        raise ValueError(f"a block holds 8 or 16 channels, got {size}")
    _native[:] = [] if size is None else [(size, True)]


def plan_count():
    """Geometries planned so far in this process."""
    return len(_plans)


def scratch_bytes():
    """Bytes of the scratch buffers the plans share (`library.SCRATCH`)."""
    return SCRATCH.nbytes()


def release_scratch():
    """Unmap the shared scratch buffers (the next call maps them again, at its own sizes): an
    evaluation's larger batch grows them past what the training steps ask, and they would be
    kept for the rest of the process (IResNetTiny at 56 px: 26 MB after steps of 64 images,
    78 MB after an evaluation at 200)."""
    SCRATCH.release()


def samples_per_call(p, n):
    """Samples of plan `p`'s batch of `n` that one call (forward, or the gradients of that
    piece) may take: as many as keep each staged (blocked) activation within what its scratch
    slot holds already, or `CALL_BYTES` if that is more. An evaluation's batch larger than
    the training batch would otherwise grow the shared slots to its size for the rest of the
    process (IResNet18, 112 px, three forwards: peak RSS 2.09 against 1.78 GB at 64 images,
    4.97 against 3.86 GB at 128); a training step whose activations stay plain (a backbone
    that does not keep them blocked) would hold two slots of its largest activation (IResNet18
    at batch 32: 2 x 103 MB)."""
    need = 1
    for name in ("src", "dst"):
        arg = p.fwd_args[name]
        if arg.nbytes:
            budget = max(CALL_BYTES, SCRATCH.held(arg.slot))
            need = max(need, -(-arg.nbytes // budget))
    return -(-n // need)


def conv_forward(p, x_ptr, w_ptr, b_ptr, y_ptr):
    """y = conv(x, w) (+ b) on float32 memory at the given addresses, in the plan's layouts."""
    p.forward(x_ptr, w_ptr, b_ptr, y_ptr)


def conv_backward(p, x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, db_ptr):
    """dx, dw (and db) of `conv_forward` for dy; a None address skips that gradient."""
    p.backward(x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, db_ptr)
