"""The seams a checkpoint family is written with (models/pretrained/layouts.py, rules.py,
config_map.py), without transformers: each against what it must equal.

- Fused layouts hold the rows of the separate projections: q, k, v of a grouped-query model
  in one `nn.Linear` (or GPT-2's `Conv1D`), gate and up in one; converting there and back
  gives the same arrays bit for bit.
- The builders, through the engine (`theirs_tensors`, `read_params`): a table with fused
  projections writes the concatenation of what the apart table writes and reads it back to
  the same parameters; cross-attention keys and values go to layer i's slice of the stacked
  `cross_kv` kernels; biases and a norm's bias follow the config.
- `SpecialIds`: each family's defaults for ids config.json leaves out, explicit nulls, lists
  of end ids, the refused decoder start, and what is written.
- `ConfigMap`: a table read both ways; constants refused by name; what a model type cannot
  express named.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.pretrained import bart, bert, gpt2, llama, marian, roberta, t5
from models.pretrained.config_map import (
    D_OVER_N,
    DECODER_START,
    MULTI_HEAD,
    ConfigMap,
    Field,
    SpecialIds,
)
from models.pretrained.convert import read_params, theirs_tensors
from models.pretrained.family import ConfigReader, Family, Inexpressible
from models.pretrained.files import Weights, write_weights
from models.pretrained.layouts import (
    FUSED_GATE_UP,
    FUSED_QKV,
    FUSED_QKV_BIAS,
    LINEAR_FROM_HEADS,
    TRANSPOSE,
    bias_to_heads,
    conv1d,
    linear_to_heads,
)
from models.pretrained.mapping import parameter_shapes
from models.pretrained.rules import (
    Attention,
    Mlp,
    Scope,
    cross_attention,
    embeddings,
    final_norm,
    mlp,
    norm,
    self_attention,
    untied_head,
)

# N=4 query heads, K=2 key/value heads, H=6, D=16, F=24.
GQA = models.TransformerConfig(
    architecture="decoder_only", vocab_size=32, d_model=16, num_heads=4, num_kv_heads=2,
    head_dim=6, mlp_dim=24, num_layers=2, max_len=16, positions="rope", norm="rmsnorm",
    activation="swiglu", use_bias=False, tie_embeddings=False, pad_id=0, eos_id=1, bos_id=1)


def _random(shape, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _random_params(cfg: models.TransformerConfig, seed: int = 0) -> dict:
    """Random values of every parameter of the unscanned model."""
    rng = np.random.default_rng(seed)
    tree: dict = {}
    for path, shape in parameter_shapes(cfg).items():
        *parents, leaf = path.split("/")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = jnp.asarray(rng.normal(size=shape), cfg.param_dtype)
    return tree


def _assert_equal_lists(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_array_equal(g, w)


# ---------------------------------------------------------------------------------------------
# 1. Layouts.

def test_fused_qkv_rows_are_the_separate_q_k_v_projections_of_a_grouped_query_model():
    n, kv = GQA.num_heads * GQA.head_dim, GQA.num_kv_heads * GQA.head_dim        # 24, 12
    w_q, w_k, w_v = _random((n, 16), 1), _random((kv, 16), 2), _random((kv, 16), 3)
    apart = [linear_to_heads("q").to_ours([w_q], GQA)[0],
             linear_to_heads("kv").to_ours([w_k], GQA)[0],
             linear_to_heads("kv").to_ours([w_v], GQA)[0]]
    assert [a.shape for a in apart] == [(16, 4, 6), (16, 2, 6), (16, 2, 6)]
    fused = np.concatenate([w_q, w_k, w_v])                                     # [48, 16]
    _assert_equal_lists(FUSED_QKV.to_ours([fused], GQA), apart)
    _assert_equal_lists(FUSED_QKV.to_theirs(apart, GQA), [fused])
    # GPT-2's Conv1D stores the transpose: the same kernels, and back to the same tensor.
    _assert_equal_lists(conv1d(FUSED_QKV).to_ours([fused.T], GQA), apart)
    _assert_equal_lists(conv1d(FUSED_QKV).to_theirs(apart, GQA), [fused.T])
    b_q, b_k, b_v = _random((n,), 4), _random((kv,), 5), _random((kv,), 6)
    biases = [bias_to_heads("q").to_ours([b_q], GQA)[0],
              bias_to_heads("kv").to_ours([b_k], GQA)[0],
              bias_to_heads("kv").to_ours([b_v], GQA)[0]]
    _assert_equal_lists(FUSED_QKV_BIAS.to_ours([np.concatenate([b_q, b_k, b_v])], GQA), biases)
    _assert_equal_lists(FUSED_QKV_BIAS.to_theirs(biases, GQA), [np.concatenate([b_q, b_k, b_v])])


def test_fused_gate_up_rows_are_gate_then_up_and_conv1d_is_the_transpose():
    w_gate, w_up = _random((24, 16), 1), _random((24, 16), 2)
    fused = np.concatenate([w_gate, w_up])
    want = [TRANSPOSE.to_ours([w_gate], GQA)[0], TRANSPOSE.to_ours([w_up], GQA)[0]]
    _assert_equal_lists(FUSED_GATE_UP.to_ours([fused], GQA), want)
    _assert_equal_lists(FUSED_GATE_UP.to_theirs(want, GQA), [fused])
    w_o = _random((16, 24), 3)                                      # the output [D, N*H]
    _assert_equal_lists(conv1d(LINEAR_FROM_HEADS).to_ours([w_o.T], GQA),
                        LINEAR_FROM_HEADS.to_ours([w_o], GQA))
    _assert_equal_lists(conv1d(TRANSPOSE).to_ours([w_o.T], GQA), [w_o.T])   # Conv1D = ours


# ---------------------------------------------------------------------------------------------
# 2. The builders, through the engine.

def _phi3_like_rules(cfg, *, conv1d_: bool = False):
    """A table with q, k, v fused in one weight and gate and up in one (as phi3 stores
    them), otherwise Llama's names."""
    layer = Scope.layers("model.layers.{i}", "decoder")
    return [*embeddings(cfg, tokens="model.embed_tokens"),
            *self_attention(cfg, layer, Attention(qkv="self_attn.qkv_proj", o="self_attn.o_proj"),
                            conv1d=conv1d_),
            *mlp(cfg, layer, Mlp(gate_up="mlp.gate_up_proj", down="mlp.down_proj"),
                 conv1d=conv1d_),
            *norm(cfg, layer, "input_layernorm", "self_attention_norm"),
            *norm(cfg, layer, "post_attention_layernorm", "mlp_norm"),
            *final_norm(cfg, "decoder", "model.norm"), *untied_head(cfg)]


def _family(rules) -> Family:
    return Family(model_type="fused_test", architectures=("Test",), config_from_hf=None,
                  config_to_hf=None, rules=rules, prefix="model.")


@pytest.mark.parametrize("conv1d_", [False, True], ids=["linear", "conv1d"])
def test_a_fused_table_writes_the_apart_tables_rows_and_reads_them_back(conv1d_, tmp_path):
    params = _random_params(GQA)
    apart = dict(theirs_tensors(llama.FAMILY, GQA, params))
    family = _family(lambda cfg: _phi3_like_rules(cfg, conv1d_=conv1d_))
    fused = dict(theirs_tensors(family, GQA, params))
    stored = (lambda w: w.T) if conv1d_ else (lambda w: w)
    for i in range(GQA.num_layers):
        p = f"model.layers.{i}."
        np.testing.assert_array_equal(
            fused[p + "self_attn.qkv_proj.weight"],
            stored(np.concatenate([apart[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])))
        np.testing.assert_array_equal(
            fused[p + "mlp.gate_up_proj.weight"],
            stored(np.concatenate([apart[p + "mlp.gate_proj.weight"],
                                   apart[p + "mlp.up_proj.weight"]])))
        np.testing.assert_array_equal(fused[p + "self_attn.o_proj.weight"],
                                      stored(apart[p + "self_attn.o_proj.weight"]))
    assert len(fused) == len(apart) - 3 * GQA.num_layers       # 5 tensors become 2 per layer
    write_weights(str(tmp_path), fused.items(), 1 << 30)
    with Weights(str(tmp_path)) as weights:
        got = read_params(weights, family, GQA)
    chex.assert_trees_all_equal(got, params, strict=True)     # bit for bit
    with Weights(str(tmp_path)) as weights:                    # and into the scanned layout
        scanned = read_params(weights, family, GQA.replace(scan_layers=True))
    stacked = scanned["decoder"]["layers"]["self_attention"]["key"]["kernel"]
    np.testing.assert_array_equal(
        stacked[1], params["decoder"]["layer_1"]["self_attention"]["key"]["kernel"])


def test_cross_attention_keys_and_values_go_to_layer_is_slice_of_the_stacked_kernels():
    cfg = bart.config_from_hf(dict(
        vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=3,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=24,
        decoder_ffn_dim=24, max_position_embeddings=16))
    layer = Scope.layers("model.decoder.layers.{i}", "decoder")
    table = cross_attention(cfg, layer, Attention.apart("encoder_attn.{}_proj", o="out"))
    assert [(r.theirs, r.ours, r.stack) for r in table if "cross_kv" in r.ours[0]] == [
        (("model.decoder.layers.{i}.encoder_attn.k_proj.weight",),
         ("cross_kv/key_kernel[{i}]",), "decoder"),
        (("model.decoder.layers.{i}.encoder_attn.k_proj.bias",),
         ("cross_kv/key_bias[{i}]",), "decoder"),
        (("model.decoder.layers.{i}.encoder_attn.v_proj.weight",),
         ("cross_kv/value_kernel[{i}]",), "decoder"),
        (("model.decoder.layers.{i}.encoder_attn.v_proj.bias",),
         ("cross_kv/value_bias[{i}]",), "decoder")]
    params = _random_params(cfg)
    theirs = dict(theirs_tensors(bart.FAMILY, cfg, params))
    kernel_LDKH = np.asarray(params["cross_kv"]["value_kernel"])
    bias_LKH = np.asarray(params["cross_kv"]["value_bias"])
    assert kernel_LDKH.shape == (3, 16, 4, 4)
    for i in range(3):            # a torch Linear [K*H, D] and its bias [K*H] per layer
        np.testing.assert_array_equal(
            theirs[f"model.decoder.layers.{i}.encoder_attn.v_proj.weight"],
            kernel_LDKH[i].reshape(16, 16).T)
        np.testing.assert_array_equal(
            theirs[f"model.decoder.layers.{i}.encoder_attn.v_proj.bias"], bias_LKH[i].reshape(-1))
        np.testing.assert_array_equal(
            theirs[f"model.decoder.layers.{i}.encoder_attn.q_proj.weight"],
            np.asarray(params["decoder"][f"layer_{i}"]["cross_attention"]["query"]["kernel"])
            .reshape(16, 16).T)


def test_biases_and_a_norms_bias_follow_the_config():
    layer = Scope.layers("h.{i}", "decoder")
    names = Attention.apart("attn.{}")

    def keys(cfg):
        rules = [*self_attention(cfg, layer, names), *norm(cfg, layer, "ln", "mlp_norm"),
                 *mlp(cfg, layer, Mlp(up="fc1", down="fc2"))]
        return [r.theirs[0].removeprefix("h.{i}.") for r in rules]

    plain = GQA.replace(activation="relu")
    assert keys(plain) == ["attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight",
                           "ln.weight", "fc1.weight", "fc2.weight"]
    assert keys(plain.replace(qkv_bias=True)) == [
        "attn.q.weight", "attn.q.bias", "attn.k.weight", "attn.k.bias", "attn.v.weight",
        "attn.v.bias", "attn.o.weight", "ln.weight", "fc1.weight", "fc2.weight"]
    assert keys(plain.replace(use_bias=True, norm="layernorm")) == [
        "attn.q.weight", "attn.q.bias", "attn.k.weight", "attn.k.bias", "attn.v.weight",
        "attn.v.bias", "attn.o.weight", "attn.o.bias", "ln.weight", "ln.bias", "fc1.weight",
        "fc1.bias", "fc2.weight", "fc2.bias"]


def test_names_that_are_neither_apart_nor_fused_are_refused():
    with pytest.raises(TypeError, match="q, k and v, or qkv"):
        Attention(q="q", k="k", o="o")
    with pytest.raises(TypeError, match="q, k and v, or qkv"):
        Attention(q="q", k="k", v="v", qkv="qkv", o="o")
    with pytest.raises(TypeError, match="gate_up"):
        Mlp(up="up", gate_up="gate_up", down="down")
    with pytest.raises(TypeError, match="apart"):
        cross_attention(GQA, Scope.layers("l.{i}", "decoder"), Attention(qkv="qkv", o="o"))


# ---------------------------------------------------------------------------------------------
# 3. Special ids: one reader with each family's defaults.

IDS = {"gpt2": gpt2.MAP.ids, "llama": llama.MAP.ids, "bart": bart.MAP.ids,
       "marian": marian.MAP.ids, "t5": t5.config_map("t5").ids, "bert": bert.MAP.ids,
       "roberta": roberta.MAP.ids}

# (family, config.json's ids) -> (pad_id, eos_id, bos_id) as read.
READ = [
    ("llama", {}, (None, None, None)),
    ("llama", {"eos_token_id": 7}, (None, 7, 7)),        # no start token: start where one ended
    ("llama", {"eos_token_id": [7, 9], "bos_token_id": 3}, (None, 7, 3)),   # Llama 3's list
    ("gpt2", {"bos_token_id": None, "eos_token_id": 5, "pad_token_id": 6}, (6, 5, 5)),
    ("bart", {}, (1, 2, 2)),                                  # BartConfig's defaults
    ("bart", {"eos_token_id": None, "pad_token_id": None}, (1, 2, 2)),   # null: the default
    ("bart", {"eos_token_id": [], DECODER_START: 0, "bos_token_id": 9}, (1, None, 0)),
    ("marian", {}, (58100, 0, 58100)),                        # MarianConfig's defaults
    ("marian", {"pad_token_id": 65, DECODER_START: 65}, (65, 0, 65)),
    ("t5", {}, (0, 1, 0)),
    ("t5", {"pad_token_id": 3}, (3, 1, 3)),                   # the decoder starts from pad
    ("t5", {"eos_token_id": None, DECODER_START: 5}, (0, None, 5)),      # null stays None
    ("bert", {}, (0, None, None)),
    ("bert", {"pad_token_id": None, "bos_token_id": 2}, (None, None, 2)),
    ("roberta", {}, (1, 2, 0)),
    ("roberta", {"bos_token_id": None, "eos_token_id": None}, (1, None, None)),
]


@pytest.mark.parametrize("family, ids, want", READ)
def test_special_ids_are_read_with_the_familys_defaults(family, ids, want):
    r = ConfigReader(ids, family)
    got = IDS[family].read(r)
    assert (got["pad_id"], got["eos_id"], got["bos_id"]) == want
    r.finish()                                     # every id was taken, bos_token_id too


@pytest.mark.parametrize("ids, match", [
    ({DECODER_START: None}, r"decoder_start_token_id=None .*needs a start token"),
    ({"pad_token_id": None}, r"decoder_start_token_id=None .*nor a pad token to start from"),
])
def test_an_encoder_decoder_without_a_start_token_is_refused_by_name(ids, match):
    with pytest.raises(ValueError, match=match):
        IDS["t5"].read(ConfigReader(ids, "t5"))


@pytest.mark.parametrize("family, written", [
    ("llama", {"pad_token_id": 4, "eos_token_id": 5, "bos_token_id": 6}),
    ("bart", {"pad_token_id": 4, "eos_token_id": 5, DECODER_START: 6, "bos_token_id": 6}),
    ("marian", {"pad_token_id": 4, "eos_token_id": 5, DECODER_START: 6, "bos_token_id": None}),
    ("t5", {"pad_token_id": 4, "eos_token_id": 5, DECODER_START: 6}),
    ("roberta", {"pad_token_id": 4, "eos_token_id": 5, "bos_token_id": 6}),
])
def test_special_ids_are_written_where_the_family_reads_them(family, written):
    cfg = GQA.replace(pad_id=4, eos_id=5, bos_id=6)
    assert IDS[family].write(cfg) == written
    back = IDS[family].read(ConfigReader(written, family))
    assert (back["pad_id"], back["eos_id"], back["bos_id"]) == (4, 5, 6)


# ---------------------------------------------------------------------------------------------
# 4. A config map, both ways.

MAP = ConfigMap(
    fields=(Field("hidden_size", "d_model"), Field("n_heads", "num_heads"),
            Field("layers", "num_layers", 2), Field("ffn", "mlp_dim"),
            Field("drop", "mlp_dropout_rate", 0.0, float), Field("eps", "norm_eps", 1e-6)),
    fixed=dict(architecture="decoder_only", norm="rmsnorm", num_kv_heads=MULTI_HEAD,
               head_dim=D_OVER_N, use_bias=False),
    constants=dict(is_encoder_decoder=False), accepted=dict(old_switch=True),
    unread=("init_std",), ids=SpecialIds(start="eos"))


def test_a_config_map_reads_and_writes_one_table():
    hf = {"hidden_size": 16, "n_heads": 4, "ffn": 32, "drop": 0, "is_encoder_decoder": False,
          "old_switch": True, "init_std": 0.02, "eos_token_id": 3, "vocab_size": 8}
    r = ConfigReader(hf, "test")
    fields = MAP.read(r)
    assert fields == dict(architecture="decoder_only", norm="rmsnorm", use_bias=False,
                          d_model=16, num_heads=4, num_layers=2, mlp_dim=32,
                          mlp_dropout_rate=0.0, norm_eps=1e-6, pad_id=None, eos_id=3, bos_id=3)
    assert isinstance(fields["mlp_dropout_rate"], float)
    with pytest.raises(ValueError, match="vocab_size=8"):          # a key nobody took
        r.finish()
    cfg = models.TransformerConfig(**fields, vocab_size=8)
    assert MAP.write(cfg, "test") == {
        "hidden_size": 16, "n_heads": 4, "layers": 2, "ffn": 32, "drop": 0.0, "eps": 1e-6,
        "is_encoder_decoder": False, "pad_token_id": None, "eos_token_id": 3,
        "bos_token_id": 3}
    # A mapped field takes any value (its PLAIN value does not bind it).
    assert MAP.write(cfg.replace(mlp_dropout_rate=0.2), "test")["drop"] == 0.2


@pytest.mark.parametrize("edit, match", [
    (dict(is_encoder_decoder=True), r"test config.json: is_encoder_decoder=True is not"),
    (dict(old_switch=False), r"old_switch=False"),
    (dict(hidden_size=None), r"test config.json has no 'hidden_size'"),
])
def test_a_config_map_refuses_values_it_cannot_compute_by_name(edit, match):
    hf = {"hidden_size": 16, "n_heads": 4, "ffn": 32, **edit}
    with pytest.raises(ValueError, match=match):
        MAP.read(ConfigReader(hf, "test"))


@pytest.mark.parametrize("change, match", [
    (dict(norm="layernorm"), "test cannot express norm='layernorm'"),
    (dict(num_kv_heads=2), "test cannot express num_kv_heads=2"),
    (dict(head_dim=8), "test cannot express head_dim=8"),
    (dict(embedding_norm=True), "test cannot express embedding_norm=True"),      # PLAIN
])
def test_a_config_map_names_what_the_model_type_cannot_express(change, match):
    cfg = models.TransformerConfig(architecture="decoder_only", vocab_size=8, d_model=16,
                                   num_heads=4, mlp_dim=32, norm="rmsnorm", use_bias=False,
                                   pad_id=None, eos_id=3, bos_id=3)
    MAP.write(cfg, "test")
    with pytest.raises(Inexpressible, match=match):
        MAP.write(cfg.replace(**change), "test")


def test_the_families_tables_cover_every_parameter_of_their_configs():
    """Each family's rules name every parameter of a config it reads exactly once (the
    engine's own check, here for configs of every family without a file)."""
    configs = [(llama.FAMILY, GQA), (gpt2.FAMILY, models.get_config("gpt-tiny")),
               (bert.FAMILY, models.get_config("bert-tiny")),
               (t5.FAMILY, t5.FAMILY.config_from_hf(dict(
                   vocab_size=40, d_model=16, d_kv=4, d_ff=24, num_layers=1, num_heads=4,
                   feed_forward_proj="gated-gelu")))]
    for family, cfg in configs:
        paths = [p.format(i=i) for r in family.rules(cfg) for i in r.layers(cfg)
                 for p in r.ours]
        leaves = {p.split("[")[0] for p in paths}
        assert leaves == set(parameter_shapes(cfg)), family.model_type
        assert len(paths) == len(set(paths)), family.model_type
