"""Quantized weights: a params leaf of fewer bits that the projections read directly.

    params = models.quantize(params, config, "int8")       # or a Pretrained: quantize(pre, ..)
    pre = models.load("opus-mt-en-de", quantize="int4")    # quantized as it is read
    logits = model.apply({"params": params}, tokens)       # the same model, the same call

Every attention and MLP projection of every family (and each expert of a mixture) holds its
kernel as a `Quantized` leaf: integer values beside float scales, the scheme named in the
leaf. Embeddings, norms, biases, the output head and convolutions keep their dtype.

    int8   symmetric, one scale per output channel: w ~ values * scale[out], values in
           [-127, 127]. A projection computes (x @ values) * scale, so the kernel is never
           rebuilt in float: the only full-size work is reading the int8 values.
    w8a8   int8's weights, and each row of the activations quantized to int8 as it
           arrives (one scale per token, its largest |x|): the product runs in integers
           with int32 sums, (x_q @ values) * x_scale * scale, where a backend multiplies
           integers faster than it converts a kernel to float (XLA's CPU backend does; on
           GPUs, int8 tensor cores do).
    int4   symmetric, one scale per output channel and per `group` consecutive inputs
           (128 by default, the common choice of GPTQ/AWQ checkpoints): values in [-7, 7],
           two to a byte (the low nibble holds the even input), so a kernel takes half a
           byte per weight plus one float32 scale per `group` weights.

The values keep the kernel's axes, in axes then out axes (int4: the flattened in axes split
into [groups, group/2 bytes]) after any leading stacked axes (scanned layers, experts,
cross-attention's layers), so `nn.scan` slices a `Quantized` leaf as it slices a kernel.

Why our own module rather than qwix: qwix quantizes by intercepting a model's `dot_general`
and `einsum` calls as it runs (quantization-aware training and on-the-fly serving), and its
linen support rewrites the modules' parameters into its own boxed types; here a quantized
tree is an ordinary value that `models.load` produces, decoding jits and the serving engine
stacks per slot, and one leaf type read by one `Projection` keeps that plain.
"""

from __future__ import annotations

import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models.errors import UserError

SCHEMES = ("int8", "int4", "w8a8")
DEFAULT_GROUP = 128
_MAX = {"int8": 127, "int4": 7, "w8a8": 127}
_INT8_VALUES = ("int8", "w8a8")


@flax.struct.dataclass
class Quantized:
    """A kernel [*lead, *in, *out] in `scheme`'s integers and float32 scales.

    int8, w8a8: values int8 [*lead, *in, *out], scales [*lead, *out].
    int4: values uint8 [*lead, G, group // 2, *out] (I = prod(in) = G * group inputs, two
          to a byte), scales [*lead, G, *out].
    """

    values: jax.Array
    scales: jax.Array
    scheme: str = flax.struct.field(pytree_node=False)
    in_shape: tuple[int, ...] = flax.struct.field(pytree_node=False)
    out_shape: tuple[int, ...] = flax.struct.field(pytree_node=False)

    @property
    def lead_shape(self) -> tuple[int, ...]:
        return tuple(self.scales.shape[:self.scales.ndim - len(self.out_shape)
                                       - (self.scheme == "int4")])

    @property
    def shape(self) -> tuple[int, ...]:
        """The float kernel's shape."""
        return (*self.lead_shape, *self.in_shape, *self.out_shape)

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.scales.nbytes)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float kernel [*lead, *in, *out] these values and scales stand for."""
        lead, n_out = self.lead_shape, len(self.out_shape)
        if self.scheme in _INT8_VALUES:
            return self.values.astype(dtype) * self.scales.astype(dtype)[
                (..., *([None] * len(self.in_shape)), *([slice(None)] * n_out))]
        w = _unpack_int4(self.values, len(lead)).astype(dtype)     # [*lead, G, group, *out]
        w = w * self.scales.astype(dtype)[(..., slice(None), None, *([slice(None)] * n_out))]
        return w.reshape(self.shape)


def _unpack_int4(packed, n_lead: int) -> jax.Array:
    """uint8 [*lead, G, group/2, *out] -> int8 [*lead, G, group, *out] (sign-extended
    nibbles, low nibble first)."""
    low = jnp.left_shift(packed, 4).astype(jnp.int8) >> 4
    high = packed.astype(jnp.int8) >> 4
    both = jnp.stack([low, high], axis=n_lead + 2)        # [*lead, G, group/2, 2, *out]
    shape = packed.shape
    return both.reshape(*shape[:n_lead + 1], shape[n_lead + 1] * 2, *shape[n_lead + 2:])


def quantize_kernel(w, scheme: str, *, n_lead: int, n_in: int,
                    group: int = DEFAULT_GROUP, name: str = "kernel") -> Quantized:
    """`w` [*lead, *in, *out] (`n_lead` leading stacked axes, `n_in` input axes) in
    `scheme`: symmetric, scales from each channel's (int4: each group's) largest |w|."""
    check_scheme(scheme)
    w = jnp.asarray(w, jnp.float32)
    lead = w.shape[:n_lead]
    in_shape, out_shape = w.shape[n_lead:n_lead + n_in], w.shape[n_lead + n_in:]
    top = _MAX[scheme]
    if scheme in _INT8_VALUES:
        in_axes = tuple(range(n_lead, n_lead + n_in))
        scales = jnp.max(jnp.abs(w), axis=in_axes) / top
        safe = jnp.where(scales == 0, 1.0, scales)
        values = jnp.clip(jnp.round(w / jnp.expand_dims(safe, in_axes)), -top, top)
        return Quantized(values.astype(jnp.int8), scales, scheme, tuple(in_shape),
                         tuple(out_shape))
    inputs = math.prod(in_shape)
    check_group(group, inputs, name)
    g = w.reshape(*lead, inputs // group, group, *out_shape)
    scales = jnp.max(jnp.abs(g), axis=n_lead + 1) / top                   # [*lead, G, *out]
    safe = jnp.where(scales == 0, 1.0, scales)
    values = jnp.clip(jnp.round(g / jnp.expand_dims(safe, n_lead + 1)), -top, top)
    values = values.astype(jnp.int8).reshape(*lead, inputs // group, group // 2, 2,
                                             *out_shape)
    low, high = jnp.take(values, 0, axis=n_lead + 2), jnp.take(values, 1, axis=n_lead + 2)
    packed = (low.astype(jnp.uint8) & 0xF) | jnp.left_shift(high.astype(jnp.uint8), 4)
    return Quantized(packed, scales, scheme, tuple(in_shape), tuple(out_shape))


def check_scheme(scheme) -> None:
    if scheme not in SCHEMES:
        raise UserError(f"quantize={scheme!r}: the schemes are {list(SCHEMES)}")


def check_group(group, inputs: int, name: str) -> None:
    if not isinstance(group, int) or isinstance(group, bool) or group < 2 or group % 2:
        raise UserError(f"int4 group={group!r}: an even number of inputs of 2 or more")
    if inputs % group:
        raise UserError(f"int4 group={group} does not divide {name}'s {inputs} inputs: "
                        f"choose a group that does (for example {_divisor(inputs, group)})")


def _divisor(inputs: int, group: int) -> int:
    return max((g for g in range(2, min(group, inputs) + 1, 2) if inputs % g == 0), default=2)


def dense(x, kernel: Quantized, dtype) -> jax.Array:
    """x [..., *in] @ kernel [*in, *out] -> [..., *out] in `dtype` (the projection's
    compute dtype), read from the quantized values without rebuilding the float kernel
    (int8); int4 unpacks its nibbles, scales them by group and contracts."""
    n_in = len(kernel.in_shape)
    if kernel.lead_shape:
        raise ValueError(f"a stacked Quantized kernel {kernel.shape} reached a projection")
    batch = x.shape[:x.ndim - n_in]
    contract = ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ()))
    if kernel.scheme == "int8":
        y = jax.lax.dot_general(x.astype(dtype), kernel.values.astype(dtype), contract)
        return y * kernel.scales.astype(dtype)[(None,) * len(batch)]
    if kernel.scheme == "w8a8":
        x_q, x_scale = quantize_rows(x, n_in)
        y = _integer_product(x_q.reshape(-1, *kernel.in_shape), kernel.values)
        y = y.reshape(*batch, *kernel.out_shape).astype(dtype)
        return (y * x_scale.astype(dtype)[(...,) + (None,) * (len(kernel.out_shape) - 1)]
                * kernel.scales.astype(dtype)[(None,) * len(batch)])
    w = kernel.dequantize(dtype).reshape(math.prod(kernel.in_shape), *kernel.out_shape)
    y = jax.lax.dot_general(x.astype(dtype).reshape(*batch, -1), w,
                            (((len(batch),), (0,)), ((), ())))
    return y.reshape(*batch, *kernel.out_shape)


def _integer_product(x_q, values):
    """int8 x_q [R, *in] @ int8 values [*in, *out] -> int32 [R, *out]. One row goes in as
    two (a zero row added, then dropped): XLA's CPU backend computes a one-row integer
    product in a loop of its own, an order of magnitude slower than the library call it
    makes for two rows or more (measured in bench.quantize's history: 26 ms against 1 ms
    for 12 [512, 2048] kernels); on other backends the extra row costs nothing to speak of.
    """
    rows = x_q.shape[0]
    if rows == 1:
        x_q = jnp.concatenate([x_q, jnp.zeros_like(x_q)])
    n_in = x_q.ndim - 1
    y = jax.lax.dot_general(x_q, values, ((tuple(range(1, n_in + 1)), tuple(range(n_in))),
                                          ((), ())), preferred_element_type=jnp.int32)
    return y[:rows]


def quantize_rows(x, n_in: int = 1):
    """x [..., *in] as int8 and one float32 scale per row (over the last `n_in` axes):
    (x_q, scale [..., 1]) with x ~ x_q * scale."""
    axes = tuple(range(x.ndim - n_in, x.ndim))
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=axes) / 127
    safe = jnp.where(scale == 0, 1.0, scale)
    x_q = jnp.clip(jnp.round(x / jnp.expand_dims(safe, axes)), -127, 127).astype(jnp.int8)
    return x_q, scale[..., None]


def stored(module: nn.Module, name: str):
    """The module's param `name` when it is a `Quantized` leaf, else None (declare it with
    `self.param` as usual)."""
    if module.has_variable("params", name):
        value = module.get_variable("params", name)
        if isinstance(value, Quantized):
            return value
    return None


def param_or_stored(module: nn.Module, name: str, init, shape, dtype):
    """`module.param(name, init, shape, dtype)`, or its `Quantized` leaf (checked against
    `shape`) where the tree holds one."""
    q = stored(module, name)
    if q is None:
        return module.param(name, init, shape, dtype)
    if q.shape != tuple(shape):
        raise UserError(f"the quantized {name} of {'/'.join(module.path)} is {q.shape}; "
                        f"the model expects {tuple(shape)}")
    return q


def is_quantized(tree) -> bool:
    return any(isinstance(leaf, Quantized) for leaf in
               jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Quantized)))


def nbytes(tree) -> int:
    """The bytes a params tree's arrays hold (quantized leaves: values plus scales)."""
    return int(sum(np.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
                   for leaf in jax.tree_util.tree_leaves(tree)))


class Embed(nn.Embed):
    """`nn.Embed` whose table may be `Quantized`. A quantized table is stored as the output
    projection a tied head reads, [D, V] with one scale per token (int4: per token and
    group of D), so `attend` is an ordinary quantized projection; a lookup takes each
    token's column of integers and rebuilds it."""

    def setup(self):
        table = stored(self, "embedding")
        if table is None:
            super().setup()
        else:
            self.embedding = table

    def __call__(self, inputs):
        table = self.embedding
        if not isinstance(table, Quantized):
            return super().__call__(inputs)
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError("Input type must be an integer or unsigned integer.")
        columns = Quantized(jnp.take(table.values, inputs, axis=-1),
                            jnp.take(table.scales, inputs, axis=-1), table.scheme,
                            table.in_shape, tuple(inputs.shape))
        return jnp.moveaxis(columns.dequantize(self.dtype or jnp.float32), 0, -1)

    def attend(self, query):
        table = self.embedding
        if not isinstance(table, Quantized):
            return super().attend(query)
        return dense(query, table, self.dtype or jnp.float32)


class Dense(nn.Dense):
    """`nn.Dense` (the untied output head) whose kernel may be `Quantized`."""

    @nn.compact
    def __call__(self, inputs):
        kernel = stored(self, "kernel")
        if kernel is None:
            return super().__call__(inputs)
        return dense(inputs, kernel, self.dtype or jnp.float32)
