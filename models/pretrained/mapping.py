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
Layouts (`layouts`) are plain numpy functions of (arrays, config); applying a rule forwards
and then backwards gives back the same tensors, bit for bit. A family writes its table with
the builders of `rules`, which know our parameter names; this module is what the engine
(`convert`) needs of a table: the layers a rule runs over, where a path lives in the tree,
and the shapes the model expects.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.axes import init_args
from models.config import TransformerConfig
from models.pretrained.layouts import SAME, Layout
from models.transformer import build


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
    args, method = init_args(cfg)               # method: an encoder-only classifier's
    model = build(cfg.replace(scan_layers=False))
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
