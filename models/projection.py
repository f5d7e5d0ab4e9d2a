"""`Projection`: a dense layer that may carry a low-rank adapter (`models.lora`).

Every attention and MLP projection is one: `x W + b` as `nn.DenseGeneral` computes it (the
same parameters, "kernel" and "bias"), plus, where the config's `lora` targets the
projection, `scale * dropout(x) A B` from its own "lora_a" [in..., r] and "lora_b"
[r, out...]. Which projection it is comes from its place in the model (`models.lora.site_of`
of the module path), so call sites only pass the config.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import quant
from models.axes import LORA_A_INIT, XAVIER_UNIFORM, ZEROS, named
from models.config import TransformerConfig
from models.errors import UserError
from models.lora import site_of


class Projection(nn.DenseGeneral):
    """`nn.DenseGeneral` over the last `len(in_axes)` dimensions of its input, its kernel's
    axes named (`in_axes` then `out_axes`), and an adapter where `config.lora` says.

    Attributes:
        config: the model's config (dtypes, biases, adapters).
        in_axes, out_axes: the kernel's logical axis names (`models.axes`).
    """

    config: TransformerConfig | None = None
    in_axes: tuple[str, ...] = ("embed",)
    out_axes: tuple[str, ...] = ("embed",)

    @classmethod
    def make(cls, config: TransformerConfig, features, name: str, *, in_axes: tuple[str, ...],
             out_axes: tuple[str, ...], bias: bool) -> Projection:
        axis = tuple(range(-len(in_axes), 0))
        return cls(features, axis=axis, use_bias=bias, dtype=config.dtype,
                   param_dtype=config.param_dtype,
                   kernel_init=named(XAVIER_UNIFORM, *in_axes, *out_axes),
                   bias_init=named(ZEROS, *out_axes), config=config, in_axes=in_axes,
                   out_axes=out_axes, name=name)

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        kernel = quant.stored(self, "kernel")
        y = super().__call__(x) if kernel is None else self._quantized(x, kernel)
        lora, site = self.config.lora, site_of(self.path)
        shape = None if lora is None or site is None else lora.shape_of(site)
        if shape is None:
            return y
        rank, scale = shape
        n_in = len(self.in_axes)
        rows, row_axis = ((x.shape[0],), ("lora_rows",)) if lora.per_row else ((), ())
        a = self.param("lora_a", named(LORA_A_INIT, *row_axis, *self.in_axes, "lora"),
                       (*rows, *x.shape[-n_in:], rank), self.param_dtype)
        b = self.param("lora_b", named(ZEROS, *row_axis, "lora", *self.out_axes),
                       (*rows, rank, *y.shape[x.ndim - n_in:]), self.param_dtype)
        x = nn.Dropout(lora.dropout)(x, deterministic=deterministic)
        dtype = self.dtype or y.dtype
        if lora.per_row:             # row b by its own adapter: a gathered low-rank product
            return y + jax.vmap(lambda x, a, b: adapted(x, a, b, scale, dtype))(
                x, a, b).astype(y.dtype)
        return y + adapted(x, a, b, scale, dtype).astype(y.dtype)

    def _quantized(self, x, kernel: quant.Quantized):
        """`x W + b` from a quantized kernel (`models.quant`), in the compute dtype."""
        features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
        n_in = len(self.in_axes)
        if kernel.in_shape != x.shape[-n_in:] or kernel.out_shape != features:
            raise UserError(f"the quantized kernel of {'/'.join(self.path)} is "
                            f"{kernel.in_shape} -> {kernel.out_shape}; the model expects "
                            f"{x.shape[-n_in:]} -> {features}")
        dtype = self.dtype or jnp.result_type(x, self.param_dtype)
        y = quant.dense(x, kernel, dtype)
        if self.use_bias:
            bias = self.param("bias", self.bias_init, features, self.param_dtype)
            y = y + bias.astype(dtype)[(None,) * (y.ndim - bias.ndim)]
        return y


def adapted(x, a, b, scale: float, dtype):
    """scale * (x A) B: x [batch..., in...], A [in..., r], B [r, out...]."""
    n_in = a.ndim - 1
    xa = jnp.tensordot(x.astype(dtype), a.astype(dtype), axes=n_in)
    return jnp.tensordot(xa, b.astype(dtype), axes=1) * jnp.asarray(scale, dtype)
