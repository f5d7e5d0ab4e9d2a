"""Weight maps between a checkpoint's tensors and our parameters, read in both directions.

A model type's weights are a table of `Rule`s. Each rule names tensors of the file
("theirs", Hugging Face key names) and our parameters ("ours", '/'-joined paths of the
unscanned model), and a `Layout` that converts one into the other and back:

    Rule("model.layers.{i}.self_attn.q_proj.weight",          # torch Linear [N*H, D]
         "decoder/layer_{i}/self_attention/query/kernel",     # DenseGeneral [D, N, H]
         linear_to_heads("q"), stack="decoder")

`{i}` runs over the layers of the rule's `stack`. Under `scan_layers` the layers' parameters
are stacked: "decoder/layer_{i}/rest" is slice i of "decoder/layers/rest" (`our_slot`).
A parameter stacked over layers in every model (the cross-attention key/value kernels) is
named by its slice: "cross_kv/key_kernel[{i}]".
Layouts are plain numpy functions of (arrays, config): transposes, reshapes and splits are
views, so converting costs no copies and no compilation. Applying a rule forwards and then
backwards gives back the same tensors, bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.config import TransformerConfig
from models.transformer import build

Convert = Callable[[list, TransformerConfig], list]


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the tensors of a rule relate: `to_ours(theirs, cfg)` and `to_theirs(ours, cfg)`,
    each mapping a list of arrays to a list of arrays."""

    to_ours: Convert
    to_theirs: Convert


@dataclasses.dataclass(frozen=True)
class Rule:
    """Tensors of the file <-> our parameters. Strings may hold `{i}`, the layer index of
    `stack` ("encoder" or "decoder"; None for a rule outside the layer stacks)."""

    theirs: tuple[str, ...]
    ours: tuple[str, ...]
    layout: Layout
    stack: str | None = None

    def __init__(self, theirs: str | Sequence[str], ours: str | Sequence[str],
                 layout: Layout | None = None, stack: str | None = None):
        object.__setattr__(self, "theirs", (theirs,) if isinstance(theirs, str) else tuple(theirs))
        object.__setattr__(self, "ours", (ours,) if isinstance(ours, str) else tuple(ours))
        object.__setattr__(self, "layout", SAME if layout is None else layout)
        object.__setattr__(self, "stack", stack)

    def layers(self, cfg: TransformerConfig) -> range:
        """The values of `{i}`: the layers of the stack, or one pass for a rule without one."""
        return range(1) if self.stack is None else range(stack_depth(cfg, self.stack))


def stack_depth(cfg: TransformerConfig, stack: str) -> int:
    """The layers of a stack: "encoder" is the encoder-decoder's encoder or the
    encoder-only stack (`num_layers`), "decoder" the stack that owns the KV cache."""
    if stack == "encoder":
        return cfg.num_encoder_layers if cfg.is_encoder_decoder else cfg.num_layers
    return cfg.decoder_layers


def our_slot(path: str, cfg: TransformerConfig) -> tuple[tuple[str, ...], int | None]:
    """Where an unscanned parameter path lives in the model's tree: (tree path, index of
    its slice on the leading layer axis, or None for a whole leaf).

        scan_layers False:  "decoder/layer_3/mlp/up/kernel" -> (decoder, layer_3, ...), None
        scan_layers True:   "decoder/layer_3/mlp/up/kernel" -> (decoder, layers, ...), 3
        either:             "cross_kv/key_kernel[3]"        -> (cross_kv, key_kernel), 3
    """
    if path.endswith("]"):
        path, index = path[:-1].split("[")
        return tuple(path.split("/")), int(index)
    parts = path.split("/")
    for k, part in enumerate(parts):
        if part.startswith("layer_") and part[6:].isdigit() and cfg.scan_layers:
            return (*parts[:k], "layers", *parts[k + 1:]), int(part[6:])
    return tuple(parts), None


def expected_shape(path: str, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of an unscanned parameter path (`parameter_shapes`), or of one layer's
    slice for "name[i]"."""
    if path.endswith("]"):
        return shapes[path[:path.index("[")]][1:]
    return shapes[path]


def whole_leaf(path: str) -> str:
    """The leaf a path names: "cross_kv/key_kernel[3]" -> "cross_kv/key_kernel"."""
    return path[:path.index("[")] if path.endswith("]") else path


def _unscanned_init(cfg: TransformerConfig):
    """(the unscanned model's `init` as a function of the key, its token arguments)."""
    tokens = jax.ShapeDtypeStruct((1, 1), "int32")
    args = (tokens, tokens) if cfg.is_encoder_decoder else (tokens,)
    model = build(cfg.replace(scan_layers=False))
    method = "classify" if cfg.num_labels else None           # an encoder-only classifier
    return functools.partial(model.init, method=method), args


@functools.lru_cache(maxsize=32)
def parameter_shapes(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the unscanned model: '/'-joined path -> shape."""
    init, args = _unscanned_init(cfg)
    tree = jax.eval_shape(init, jax.random.key(0), *args)["params"]
    return {"/".join(k.key for k in path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def initial_params(cfg: TransformerConfig, paths) -> dict[str, np.ndarray]:
    """The values `model.init` (key 0) gives the unscanned parameter `paths` ("name[i]"
    for one layer's slice), on the host: a head that a checkpoint lacks. Only those
    leaves leave the compiled init."""
    init, args = _unscanned_init(cfg)
    tokens = [jnp.zeros(a.shape, a.dtype) for a in args]

    def pick(key):
        tree = init(key, *tokens)["params"]
        out = {}
        for path in paths:
            leaf = tree
            for part in whole_leaf(path).split("/"):
                leaf = leaf[part]
            out[path] = leaf[int(path[path.index("[") + 1:-1])] if path.endswith("]") else leaf
        return out

    return jax.device_get(jax.jit(pick)(jax.random.key(0)))


def untied_head(cfg: TransformerConfig, layout: Layout | None = None) -> list[Rule]:
    """The output projection's rule when it is not the tied embedding (`lm_head.weight`, a
    torch Linear [V, D] by default): no rule when tied."""
    return [] if cfg.tie_embeddings else [Rule("lm_head.weight", "head/kernel",
                                               layout or TRANSPOSE)]


# ---------------------------------------------------------------------------------------------
# Layouts. N query heads, K key/value heads, H head dim, D model width (dims named as in
# STYLE.md); torch `nn.Linear` stores [out, in], GPT-2's `Conv1D` stores [in, out].

def _one(to_ours, to_theirs) -> Layout:
    """A layout of one tensor to one parameter."""
    return Layout(lambda xs, cfg: [to_ours(xs[0], cfg)], lambda xs, cfg: [to_theirs(xs[0], cfg)])


SAME = _one(lambda x, cfg: x, lambda x, cfg: x)
TRANSPOSE = _one(lambda x, cfg: x.T, lambda x, cfg: x.T)          # Linear [out, in] <-> [in, out]


def _heads(cfg: TransformerConfig, which: str) -> int:
    return cfg.num_heads if which == "q" else cfg.num_kv_heads


def linear_to_heads(which: str) -> Layout:
    """A q/k/v `nn.Linear` [heads*H, D] <-> a DenseGeneral kernel [D, heads, H]; `which` is
    "q" (N heads) or "kv" (K heads)."""
    return _one(
        lambda w, cfg: w.T.reshape(w.shape[1], _heads(cfg, which), cfg.head_dim),
        lambda k, cfg: k.reshape(k.shape[0], -1).T)


def bias_to_heads(which: str) -> Layout:
    """A q/k/v bias [heads*H] <-> [heads, H]."""
    return _one(lambda b, cfg: b.reshape(_heads(cfg, which), cfg.head_dim),
                lambda b, cfg: b.reshape(-1))


LINEAR_FROM_HEADS = _one(                 # the output `nn.Linear` [D, N*H] <-> [N, H, D]
    lambda w, cfg: w.T.reshape(cfg.num_heads, cfg.head_dim, w.shape[0]),
    lambda k, cfg: k.reshape(-1, k.shape[-1]).T)
CONV1D_FROM_HEADS = _one(                 # GPT-2's output Conv1D [N*H, D] <-> [N, H, D]
    lambda w, cfg: w.reshape(cfg.num_heads, cfg.head_dim, w.shape[1]),
    lambda k, cfg: k.reshape(-1, k.shape[-1]))


def _split3(x, axis: int) -> list:
    return list(np.split(x, 3, axis=axis))


CONV1D_FUSED_QKV = Layout(                # GPT-2's c_attn [D, 3*N*H] <-> q, k, v [D, N, H]
    lambda xs, cfg: [w.reshape(w.shape[0], cfg.num_heads, cfg.head_dim)
                     for w in _split3(xs[0], 1)],
    lambda ks, cfg: [np.concatenate([k.reshape(k.shape[0], -1) for k in ks], axis=1)])
FUSED_QKV_BIAS = Layout(                  # its bias [3*N*H] <-> q, k, v [N, H]
    lambda xs, cfg: [b.reshape(cfg.num_heads, cfg.head_dim) for b in _split3(xs[0], 0)],
    lambda bs, cfg: [np.concatenate([b.reshape(-1) for b in bs])])
