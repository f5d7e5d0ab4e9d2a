"""Sequence-level training of an encoder-decoder: the model learns from what it generates,
scored by a reward on whole sentences, instead of (or beside) teacher forcing's gold
prefixes. Two objectives (`sequence.objective`):

    mrt    minimum risk training (Shen et al. 2016): per source, K candidates drawn from the
           current parameters (samples, or the K best beams), optionally with the reference;
           the risk is their expected cost (1 - reward) under p ** alpha renormalised over
           the distinct candidates, its gradient flowing through their log-probabilities.
    scst   self-critical REINFORCE (Rennie et al. 2017): K samples per source, the greedy
           output's reward as the baseline: loss = -(r(sample) - r(greedy)) * log p(sample),
           averaged over the samples.

    objective = SequenceLevel.build(model_config, tokenizer, settings, model_name="m")
    task = objective.prepare(batch, key=key, row_ids=rows)   # targets, weights, row keys
    sums = objective.loss_sums(model, params, batch, task, dropout_rng=k1, sample_rng=k2,
                               step=step, train=True)

The loss mixes with teacher forcing by `sequence.loss_weight` w, per target token: a
sentence of n reference tokens adds (1 - w) x its n tokens' cross-entropy (label smoothing
and z-loss included) + w x n x its sequence loss, and the step divides by the batch's
reference tokens as for next-token prediction. So w = 0 is next-token training exactly, and
each sentence's sequence loss counts once per reference token (Shen et al. average their
risk over sentences; the weighting here puts both losses on one per-token scale and keeps
the step's one normaliser). The gold pass runs at every w, for the logged loss, accuracy and
perplexity.

The rewards are computed on the host inside the step (`jax.pure_callback`, see
`train.objectives.sequence_rewards`), so the step, the wrappers and the trainer are the
ones every objective uses. The candidates are drawn per global row from the step key
(`train.objectives.sequence_candidates`): exact on resume, and a device split draws what
one device does. Training logs the mean `reward` of the candidates, the `risk` (mrt: the
expected cost under the sharpened candidate distribution; scst: the samples' mean cost
1 - reward) and for scst the greedy baseline's `greedy_reward`. Evaluation is next-token
prediction's: the validation loss, and decoded BLEU or exact match.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from models.errors import UserError
from train import losses
from train.config_checks import fail
from train.objectives.base import Objective
from train.objectives.next_token import NextToken, forward, shift_right
from train.objectives.sequence_candidates import (
    Drawing,
    candidate_logprobs,
    draw,
    greedy,
    pad_width,
    row_keys,
)
from train.objectives.sequence_rewards import HostRewards, on_device, reward_function, score
from train.objectives.sequence_risk import expected_risk, first_occurrences, self_critical
from train.objectives.sequence_settings import SequenceSettings


@dataclasses.dataclass(frozen=True)
class SequenceLevel(Objective):
    """Minimum risk training or self-critical REINFORCE (see the module docstring).

    Attributes:
        token: the next-token objective of the gold pass (its BOS, smoothing, z-loss) and
            of evaluation.
        settings: the `sequence.*` keys.
        rewards: the host reward of detokenised candidates.
    """

    name = "sequence level"
    token: NextToken
    settings: SequenceSettings
    rewards: HostRewards

    @classmethod
    def check_settings(cls, settings, model_config, *, model_name: str) -> None:
        """Refuses scheduled sampling: the candidates are the model's own outputs already;
        and `loss_chunks`: the candidates' pass needs their whole logits."""
        if settings.scheduled_sampling.enabled:
            raise UserError(f"scheduled_sampling.enabled=True is next-token prediction's "
                            f"option; sequence.objective={settings.sequence.objective!r} "
                            "trains on the model's own candidates already (set one of the "
                            "two)")
        super().check_settings(settings, model_config, model_name=model_name)

    @classmethod
    def build(cls, model_config, tokenizer, settings, *, model_name: str,
              decodes: bool = False) -> SequenceLevel:
        seq: SequenceSettings = settings.sequence
        token = NextToken.build(model_config, tokenizer, settings, model_name=model_name,
                                decodes=decodes)
        if model_config.max_len < seq.max_new_tokens + 1:
            raise fail("sequence.max_new_tokens", seq.max_new_tokens,
                       f"needs {seq.max_new_tokens + 1} decoder positions (the start token "
                       f"and the candidate); model {model_name!r} has max_len="
                       f"{model_config.max_len}")
        if tokenizer is None:
            raise UserError("sequence-level training scores detokenised text: it needs the "
                            "run's tokenizer")
        fn = reward_function(seq.reward)
        score(fn, ["a b"], ["a b"], name=seq.reward)    # a finite number, before any step
        return cls(token=token, settings=seq, rewards=HostRewards(fn, tokenizer, seq.reward))

    @property
    def drawing(self) -> Drawing:
        s = self.settings
        return Drawing(candidates=s.candidates, sampling=s.sampling, temperature=s.temperature,
                       top_k=s.top_k, max_new_tokens=s.max_new_tokens)

    def pipeline_options(self):
        return self.token.pipeline_options()

    def init_inputs(self, row: dict):
        return self.token.init_inputs(row)

    def prepare(self, batch: dict, *, key, row_ids) -> dict:
        """Next-token prediction's targets and weights, and `row_keys`: each row's key for
        its candidates (`fold_in(key, global row id)`)."""
        task = self.token.prepare(batch, key=key, row_ids=row_ids)
        task["row_keys"] = row_keys(key, row_ids)
        return task

    def evaluate(self, run, state, *, final: bool):
        return self.token.evaluate(run, state, final=final)

    def loss_sums(self, model, params, batch: dict, task: dict, *, dropout_rng, sample_rng,
                  step, train: bool) -> dict:
        """The gold pass's token sums, with the mixed loss while training (and the reward
        and risk sums with their counts: `reward`/`reward_count`, `risk`/`risk_count`,
        scst's `greedy_reward`/`greedy_reward_count`)."""
        del sample_rng, step
        token = self.token
        dec_in = shift_right(batch["targets"], batch["targets_position"],
                             batch["targets_segmentation"], token.bos_id)
        logits = forward(model, params, batch, dec_in, dropout_rng=dropout_rng,
                         deterministic=not train)
        sums = losses.cross_entropy(logits, task["targets"], task["weights"],
                                    label_smoothing=token.label_smoothing if train else 0.0,
                                    z_loss=token.z_loss)
        w = self.settings.loss_weight
        if not train or w == 0:
            return sums
        seq_B, extra = self.sequence_losses(model, params, batch, task,
                                            dropout_rng=dropout_rng)
        length_B = jnp.sum(task["weights"], axis=-1)
        sums["loss"] = (1.0 - w) * sums["loss"] + w * jnp.sum(length_B * seq_B)
        sums.update(extra)
        return sums

    def sequence_losses(self, model, params, batch: dict, task: dict, *, dropout_rng
                        ) -> tuple[jnp.ndarray, dict]:
        """(each source's sequence loss float32[B], the metric sums): draw, reward on the
        host, score teacher-forced, then the risk (mrt) or the self-critical loss (scst)."""
        s = self.settings
        sources = batch["inputs"]
        source_lengths = jnp.sum(batch["inputs_segmentation"] > 0, axis=-1).astype(jnp.int32)
        ref_lengths = jnp.sum(task["weights"] > 0, axis=-1).astype(jnp.int32)
        real_B = ref_lengths > 0
        tokens, lengths = draw(model, params, sources, source_lengths, task["row_keys"],
                               drawing=self.drawing)
        B, K, N = tokens.shape          # K drawn candidates per source
        width = max(N, task["targets"].shape[1])
        tokens = pad_width(tokens, width)
        if s.objective == "mrt" and s.include_gold:     # the reference first
            gold = pad_width(task["targets"], width)
            tokens = jnp.concatenate([gold[:, None], tokens], axis=1)
            lengths = jnp.concatenate([ref_lengths[:, None], lengths], axis=1)
        if s.objective == "scst":                       # the greedy output last, rewarded only
            g_tokens, g_lengths = greedy(model, params, sources, source_lengths,
                                         max_new_tokens=s.max_new_tokens)
            scored = jnp.concatenate([tokens, pad_width(g_tokens, width)[:, None]], axis=1)
            scored_lengths = jnp.concatenate([lengths, g_lengths[:, None]], axis=1)
        else:
            scored, scored_lengths = tokens, lengths
        C = scored.shape[1]
        rewards = on_device(self.rewards, scored.reshape(B * C, width),
                            scored_lengths.reshape(B * C), task["targets"],
                            ref_lengths).reshape(B, C)
        logp = candidate_logprobs(model, params, batch, tokens, lengths,
                                  bos_id=self.token.bos_id, dropout_rng=dropout_rng,
                                  train=True)
        real = real_B.astype(jnp.float32)
        if s.objective == "mrt":
            drawn = rewards[:, C - K:]                  # behind the reference, if there
            keep = first_occurrences(tokens, lengths) & real_B[:, None]
            seq_B = expected_risk(logp, 1.0 - rewards, keep, alpha=s.alpha)
            extra = {"risk": jnp.sum(seq_B * real)}
        else:
            drawn, baseline = rewards[:, :K], rewards[:, K]
            seq_B = self_critical(logp, drawn, baseline, jnp.broadcast_to(real_B[:, None],
                                                                          (B, K)))
            extra = {"risk": jnp.sum((1.0 - jnp.mean(drawn, axis=-1)) * real),
                     "greedy_reward": jnp.sum(baseline * real),
                     "greedy_reward_count": jnp.sum(real)}
        # The logged reward: the mean of the drawn candidates (the reference left out).
        extra.update({"reward": jnp.sum(drawn * real[:, None]),
                      "reward_count": jnp.sum(real) * K, "risk_count": jnp.sum(real)})
        return seq_B, extra
