"""cuDNN's fused attention on a GPU, through `jax.nn.dot_product_attention`.

It takes the masks a fused kernel expresses without a [T, S] array: causal over a
teacher-forced sequence (query i sees keys <= i), a sliding window over it, and right
padding given as lengths. `unsupported` names what it cannot take, and `attend` refuses
that by name rather than change what is computed: packed segment ids, T5's relative bias
(a [T, S] table), attention dropout, queries at cached positions (prefill and decoding
steps, whose causal mask is offset), keys shared by several query rows (beams), logit
soft-capping, a window switched per layer inside a scan, and float32 (the kernels run
float16 and bfloat16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.masks import MaskSpec


def unsupported(q_BTNH, k_BSKH, spec: MaskSpec, bias, *, dropout_rate: float,
                softcap: float | None = None) -> str | None:
    """Why cuDNN cannot compute this attention exactly (None: it can)."""
    if jax.default_backend() != "gpu":
        return f"it needs a GPU (the backend is {jax.default_backend()})"
    if q_BTNH.dtype not in (jnp.bfloat16, jnp.float16):
        return f"its kernels run float16 or bfloat16, not {q_BTNH.dtype} (set dtype)"
    if bias is not None:
        return "it takes no relative position bias without a [T, S] table"
    if spec.q_segment is not None:
        return "it takes no packed segment ids"
    if dropout_rate > 0.0:
        return f"it applies no attention dropout (attention_dropout_rate={dropout_rate})"
    if k_BSKH.shape[0] != q_BTNH.shape[0]:
        return "its keys cannot be shared by several query rows (beams)"
    if spec.window_on is not None:
        return "its window cannot be switched per layer inside a scanned stack (layer_types)"
    if spec.window is not None and not spec.causal:
        return "its window is a causal one (the most recent keys), not one on both sides"
    if spec.chunk is not None:
        return f"it has no chunked local mask (attention_chunk_size={spec.chunk})"
    if softcap is not None:
        return f"it applies no logit soft-capping (attn_logit_softcapping={softcap})"
    if (spec.causal or spec.window is not None) and not spec.aligned:
        return "its causal mask cannot be offset (queries at cached positions)"
    return None


def cudnn_attention(q_BTNH, k_BSKH, v_BSKH, spec: MaskSpec, *, scale: float):
    """softmax(scale q k^T, masked) v by cuDNN; `unsupported(...)` must be None."""
    def lengths(valid):
        return None if valid is None else jnp.sum(valid, axis=-1, dtype=jnp.int32)
    window = None if spec.window is None else (spec.window - 1, 0)
    return jax.nn.dot_product_attention(
        q_BTNH, k_BSKH, v_BSKH, scale=scale, is_causal=spec.causal,
        query_seq_lengths=lengths(spec.q_valid), key_value_seq_lengths=lengths(spec.k_valid),
        local_window_size=window, implementation="cudnn")
