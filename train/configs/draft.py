"""A draft for the default model: the same task and tokenizer, a quarter of its width and
half its depth, for speculative decoding (`decode.speculative`).

    python -m train                                        # the default model, runs/default
    python -m train --config draft --workdir runs/draft    # its draft, with its tokenizer
    python -m decode --model runs/default/model --draft-model runs/draft/model "..."

The draft reads the default run's tokenizer (`tokenizer_from`), so both models share their
vocabulary, as speculative decoding needs. Expected on 2 CPU cores: see the README's
decoding benchmarks (tokens per second of greedy decoding with and without the draft, and
the share of its tokens the default model accepts).
"""

from train.configs import default


def get_config():
    c = default.get_config()
    c.tokenizer_from = "runs/default/model"
    c.model_overrides.d_model = 64
    c.model_overrides.num_heads = 4
    c.model_overrides.mlp_dim = 128
    c.model_overrides.num_encoder_layers = 1
    c.model_overrides.num_decoder_layers = 1
    c.num_train_steps = 1000
    c.eval_every_steps = 500
    return c
