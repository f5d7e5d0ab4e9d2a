"""Keys every config has, with the Flax WMT example's names where one exists."""

import ml_collections


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # Model: a preset from models.list_configs() plus overrides; vocab_size comes from the
    # tokenizer and max_len from the longest sequence.
    c.model = "transformer-tiny"
    c.model_overrides = ml_collections.ConfigDict()
    # Fine-tuning: a model directory (Hugging Face layout, or a run's WORKDIR/model) whose
    # config, weights and tokenizer the run starts from; `model`, `tokenizer` and
    # `vocab_size` are then unused and model_overrides may only set dtype, dropout, scan.
    c.init_from = ""
    c.dtype = "float32"                    # compute dtype; parameters stay float32
    # Data.
    c.dataset = "toy_translation"
    c.data_files = ""                      # comma-separated paths for local_* datasets
    c.data_dir = ""                        # TFDS data dir ("" = TFDS default)
    c.reverse_translation = False
    c.tokenizer = "sentencepiece"          # or "byte"
    c.vocab_size = 1024
    c.spm_model_type = "unigram"
    c.max_source_length = 64
    c.max_target_length = 64
    c.packing = True
    c.overlong = "drop"
    c.data_workers = 0
    c.eval_split = "validation"
    c.test_split = "test"
    # Optimisation.
    c.per_device_batch_size = 32
    c.num_train_steps = 1000
    c.learning_rate = 2e-3
    c.warmup_steps = 200
    c.lr_decay = "rsqrt"                   # rsqrt | cosine | constant
    c.adam_b1 = 0.9
    c.adam_b2 = 0.98
    c.adam_eps = 1e-9
    c.weight_decay = 0.0
    c.grad_clip_norm = 1.0
    c.grad_accum_steps = 1
    c.label_smoothing = 0.1
    c.z_loss = 0.0
    # Masked LM (encoder-only models on text): of the real, non-special tokens, mlm_rate
    # are chosen; of those mlm_mask_fraction become the mask token, mlm_random_fraction a
    # random token, the rest stay (BERT's 15% and 80/10/10).
    c.mlm_rate = 0.15
    c.mlm_mask_fraction = 0.8
    c.mlm_random_fraction = 0.1
    c.parallel = "pmap"                    # pmap | shard_map | sharded (train.sharding)
    # parallel="sharded": the device mesh (data, fsdp, tensor), -1 = the devices the others
    # leave (FSDP over all by default), and the logical-axis rules (() = the defaults,
    # models.axes.DEFAULT_RULES; see README "Sharded training").
    c.mesh_shape = (1, -1, 1)
    c.logical_axis_rules = ()
    c.seed = 0
    c.scheduled_sampling = ml_collections.ConfigDict(dict(
        enabled=False, schedule="linear", max_rate=0.25, ramp_steps=1000, k=0.999))
    # Loop, evaluation, checkpoints.
    c.log_every_steps = 50
    c.eval_every_steps = 500
    c.checkpoint_every_steps = 500
    c.keep_checkpoints = 3
    c.num_eval_decode = 200                # validation examples decoded at each evaluation
    c.num_test_decode = 1000               # test examples decoded at the end (0 = none)
    c.eval_per_device_batch_size = 64
    # Fine-tuning (init_from), decoded evaluations follow the directory's
    # generation_config.json (beams, length penalty, forced and banned ids, end ids);
    # beam_size is used only when it names no beam count, length_penalty never.
    c.beam_size = 4
    c.length_penalty = 0.6                 # GNMT's alpha: ((5 + length) / 6) ** alpha
    c.max_decode_length = 64
    c.show_examples = 3
    c.metric = "exact_match"               # exact_match | bleu | both (decoded evaluation)
    # Multi-host: jax.distributed.initialize() when set; the other three only with a
    # coordinator address ("" = let JAX detect the cluster: TPU pod, SLURM, Open MPI, k8s).
    c.distributed = False
    c.coordinator_address = ""             # host:port of process 0
    c.num_processes = 1
    c.process_id = 0
    return c
