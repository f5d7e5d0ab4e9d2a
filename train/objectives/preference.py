"""Preference training of a decoder-only model on (prompt, chosen, rejected) pairs: DPO
(Rafailov et al. 2023), IPO (Azar et al. 2023) or the reference-free SimPO (Meng et al.
2024), as `dpo.loss` says (`train.objectives.preference_settings`).

A batch row holds one pair (`train.data.kinds.PREFERENCE`): the prompt in `inputs`, the
chosen response in `targets`, the rejected one in `rejected`, each ending in EOS. Each
response is joined to the prompt (its EOS dropped) and scored on its own tokens alone,
its EOS included:

    inputs    [p1 p2 EOS  0]        targets  [c1 EOS 0]      rejected [r1 r2 EOS]
    chosen row   [p1 p2 c1 EOS 0 0]      scored [0 0 1 1 0 0]
    rejected row [p1 p2 r1 r2 EOS 0]     scored [0 0 1 1 1 0]

Both rows go through the model in one batch, read behind the model's start token as next-
token prediction reads text. The reference is the model the run starts from, never
trained: an adapted model's base itself (its adapters' contribution set to zero: no second
copy of the weights), or in full fine-tuning the copy the train state keeps
(`TrainState.reference`). Dropout is off for both (their log-probs must be comparable).

Per pair, with log-ratios `c = log p(chosen) - log p_ref(chosen)` and `r` alike:

    sigmoid   -log sigmoid(beta (c - r))
    ipo       ((c - r) - 1 / (2 beta)) ** 2          (log-probs averaged over tokens)
    simpo     -log sigmoid(beta (mean log p(chosen) - mean log p(rejected)) - gamma)

The metrics are those users know from TRL and Tunix: the rewards `beta c` and `beta r`
(`reward_chosen`, `reward_rejected`; SimPO's are beta x the mean log-probs), their margin
(`reward_margin`), `accuracy` (the share of pairs whose chosen reward is the higher), the
responses' log-probs (`logps_chosen`, `logps_rejected`), and `nll`, the chosen
responses' mean token loss.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models import lora
from models.errors import UserError
from train.objectives.base import Objective
from train.objectives.next_token import forward
from train.objectives.preference_settings import PreferenceSettings

SIDES = ("targets", "rejected")              # the chosen and the rejected responses


def joined_rows(prompt_BP, prompt_seg_BP, response_BR, response_seg_BR):
    """Each response behind its prompt (the prompt's EOS dropped), width P - 1 + R:
    (tokens, scored: 1.0 on the response's tokens, segmentation: 1 on the real tokens)."""
    width = prompt_BP.shape[1] - 1 + response_BR.shape[1]
    t = jnp.arange(width)[None, :]
    prompt_len = jnp.sum(prompt_seg_BP > 0, axis=1, keepdims=True) - 1
    response_len = jnp.sum(response_seg_BR > 0, axis=1, keepdims=True)
    rows = prompt_BP.shape[0]
    from_prompt = jnp.take_along_axis(
        prompt_BP, jnp.broadcast_to(jnp.minimum(t, prompt_BP.shape[1] - 1), (rows, width)),
        axis=1)
    at = jnp.clip(t - prompt_len, 0, response_BR.shape[1] - 1)
    from_response = jnp.take_along_axis(response_BR, at, axis=1)
    scored = (t >= prompt_len) & (t < prompt_len + response_len)
    real = t < prompt_len + response_len
    tokens = jnp.where(t < prompt_len, from_prompt, jnp.where(scored, from_response, 0))
    return tokens, scored.astype(jnp.float32), real.astype(jnp.int32)


def token_logprobs(model, params, rows_BT, scored_BT, real_BT, *, bos_id: int,
                   temperature: float = 1.0):
    """Each scored token's log-prob (0 elsewhere), `[B, T]`, read as next-token prediction
    reads the rows: behind `bos_id`, without dropout; the logits divided by
    `temperature` (GRPO's, as its rollouts sample)."""
    decoder_in = jnp.where(real_BT > 0, jnp.pad(rows_BT, ((0, 0), (1, 0)))[:, :-1], 0)
    decoder_in = decoder_in.at[:, 0].set(jnp.where(real_BT[:, 0] > 0, bos_id, 0))
    positions = jnp.broadcast_to(jnp.arange(rows_BT.shape[1]), rows_BT.shape)
    batch = {"targets_segmentation": real_BT, "targets_position": positions}
    logits = forward(model, params, batch, decoder_in, dropout_rng=None, deterministic=True)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    picked = jnp.take_along_axis(logp, rows_BT[..., None], axis=-1)[..., 0]
    return picked * scored_BT


def response_logprobs(model, params, rows_BT, scored_BT, real_BT, *, bos_id: int):
    """(sum, count) of the log-probs of each row's scored tokens (`token_logprobs`)."""
    picked = token_logprobs(model, params, rows_BT, scored_BT, real_BT, bos_id=bos_id)
    return jnp.sum(picked, axis=1), jnp.sum(scored_BT, axis=1)


def reference_params(params, reference):
    """The frozen reference's parameters: `reference` when the state keeps a copy, else
    (an adapted model) `params` with every adapter zeroed, which is the base model."""
    if reference is not None:
        return jax.lax.stop_gradient(reference)
    base, adapters = lora.split(params)
    return jax.lax.stop_gradient(lora.join(base, jax.tree.map(jnp.zeros_like, adapters)))


def pair_losses(settings: PreferenceSettings, chosen, rejected, ref_chosen, ref_rejected,
                n_chosen, n_rejected):
    """(loss, reward of the chosen, reward of the rejected) per pair, from summed response
    log-probs and token counts (the module docstring's formulas)."""
    beta = settings.beta
    if settings.loss == "simpo":
        c, r = chosen / n_chosen, rejected / n_rejected
        return jax.nn.softplus(-(beta * (c - r) - settings.simpo_gamma)), beta * c, beta * r
    if settings.loss == "ipo":
        c = chosen / n_chosen - ref_chosen / n_chosen
        r = rejected / n_rejected - ref_rejected / n_rejected
        return (c - r - 1.0 / (2.0 * beta)) ** 2, beta * c, beta * r
    c, r = chosen - ref_chosen, rejected - ref_rejected
    return jax.nn.softplus(-beta * (c - r)), beta * c, beta * r


@dataclasses.dataclass(frozen=True)
class AgainstReference(Objective):
    """What preference training and GRPO share: a decoder-only model that reads each row
    behind its start token, a loss over whole sequences (no label smoothing), and a
    reference model: an adapted model's base (adapters off), or in full fine-tuning a
    frozen copy the train state keeps (`needs_reference_copy`). A subclass names its loss
    and what it reads behind the start token (for messages) and has `settings` with
    `needs_reference`.

    Attributes:
        bos_id: the start token each row is read behind.
        adapted: the model has adapters, so the reference is its base (else the train
            state's copy).
    """

    WHOLE_LOSS = "the loss compares whole sequences"     # why no label smoothing
    READ = "each row"                                     # what is read behind bos_id
    bos_id: int
    adapted: bool = False

    @classmethod
    def check_settings(cls, settings, model_config, *, model_name: str) -> None:
        super().check_settings(settings, model_config, model_name=model_name)
        if settings.label_smoothing:
            raise UserError(f"label_smoothing={settings.label_smoothing} smooths a token "
                            f"loss; {cls.WHOLE_LOSS}: set it to 0")

    @classmethod
    def start_id(cls, model_config, *, model_name: str) -> int:
        """The model's start token, or a `UserError` naming the model that has none."""
        if model_config.bos_id is None:
            raise UserError(f"model {model_name!r} has no start token (bos_id), which "
                            f"{cls.READ} is read behind")
        return int(model_config.bos_id)

    @property
    def needs_reference_copy(self) -> bool:
        """Full fine-tuning against a reference: the train state keeps a frozen copy."""
        return self.settings.needs_reference and not self.adapted


@dataclasses.dataclass(frozen=True)
class Preference(AgainstReference):
    """Preference training (see the module docstring).

    Attributes:
        settings: the `dpo.*` keys.
    """

    name = "preference"
    WHOLE_LOSS = "the preference loss compares whole responses"
    READ = "each prompt and response"
    settings: PreferenceSettings = dataclasses.field(default_factory=PreferenceSettings)

    @classmethod
    def build(cls, model_config, tokenizer, settings, *, model_name: str) -> Preference:
        del tokenizer
        return cls(bos_id=cls.start_id(model_config, model_name=model_name),
                   settings=settings.dpo, adapted=model_config.lora is not None)

    def init_inputs(self, row: dict) -> tuple[tuple, str | None]:
        return (row["targets"],), None

    def prepare(self, batch: dict, *, key, row_ids) -> dict:
        """One weight a pair (0 for an empty row); `targets` the chosen responses."""
        del key, row_ids
        pairs_B = (batch["inputs_segmentation"][:, 0] > 0).astype(jnp.float32)
        return {"targets": batch["targets"][:, 0], "weights": pairs_B}

    def loss_sums(self, model, params, batch: dict, task: dict, *, dropout_rng, sample_rng,
                  step, train: bool, reference=None) -> dict:
        del dropout_rng, sample_rng, step, train
        rows = [joined_rows(batch["inputs"], batch["inputs_segmentation"], batch[side],
                            batch[f"{side}_segmentation"]) for side in SIDES]
        width = max(r[0].shape[1] for r in rows)
        tokens, scored, real = (jnp.concatenate(
            [jnp.pad(r[i], ((0, 0), (0, width - r[i].shape[1]))) for r in rows])
            for i in range(3))
        pairs = task["weights"]
        b = pairs.shape[0]
        logps, counts = response_logprobs(model, params, tokens, scored, real,
                                          bos_id=self.bos_id)
        counts = jnp.maximum(counts, 1.0)
        if self.settings.needs_reference:
            if reference is None and not self.adapted:
                raise ValueError("full fine-tuning against a reference needs the train "
                                 "state's copy (TrainState.reference)")
            ref, _ = response_logprobs(model, reference_params(params, reference), tokens,
                                       scored, real, bos_id=self.bos_id)
        else:
            ref = jnp.zeros_like(logps)
        loss, reward_c, reward_r = pair_losses(self.settings, logps[:b], logps[b:], ref[:b],
                                               ref[b:], counts[:b], counts[b:])
        n = jnp.sum(pairs)
        sums = {"loss": jnp.sum(loss * pairs), "weight": n,
                "nll": jnp.sum(-logps[:b] / counts[:b] * pairs),
                "correct": jnp.sum((reward_c > reward_r) * pairs),
                "reward_chosen": jnp.sum(reward_c * pairs),
                "reward_rejected": jnp.sum(reward_r * pairs),
                "reward_margin": jnp.sum((reward_c - reward_r) * pairs),
                "logps_chosen": jnp.sum(logps[:b] * pairs),
                "logps_rejected": jnp.sum(logps[b:] * pairs)}
        for name in ("reward_chosen", "reward_rejected", "reward_margin", "logps_chosen",
                     "logps_rejected"):
            sums[f"{name}_count"] = n
        return sums
