"""A tiny training config on the built-in `copy` task, cheap enough for many runs."""

from train import configs


def tiny_train_config(data_dir: str, **overrides):
    c = configs.get("copy")
    c.data_dir = data_dir
    # No biases: a key bias has a mathematically zero gradient (softmax ignores it), and
    # adam turns the rounding noise it gets instead into full-size updates, which differ
    # with the order of the device sums; runs on different topologies are compared here.
    c.model_overrides.update(d_model=32, num_heads=2, mlp_dim=64, num_encoder_layers=1,
                             num_decoder_layers=1, use_bias=False)
    c.update(max_source_length=24, max_target_length=24, max_decode_length=8,
             per_device_batch_size=2, eval_per_device_batch_size=250, num_train_steps=6,
             warmup_steps=2, log_every_steps=1, checkpoint_every_steps=3,
             eval_every_steps=1000, num_eval_decode=0, num_test_decode=0, beam_size=2,
             keep_checkpoints=5)
    for k, v in overrides.items():
        c[k] = v
    return c
