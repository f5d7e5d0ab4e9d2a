"""Group-relative policy optimisation (Shao et al. 2024, GRPO; and Liu et al. 2025's Dr. GRPO)
of a decoder-only model on prompts whose completions a reward checks (`grpo.*`,
`train.objectives.grpo_settings`).

Each step, inside the jitted train step:

1. Rollouts: every prompt row draws G = `grpo.num_generations` completions from the
   current parameters with the project's sampler (`decode.generate` under `jax.vmap`, as
   `train.objectives.sequence_candidates.draw` draws), each row's key `fold_in(step key,
   global row id)`: the same completions wherever the row is, and a resumed run draws what
   the straight run did. The model reads the prompt behind its start token, as it was
   fine-tuned to (the prompt's stored EOS dropped).
2. Rewards: the completions, their prompts and answers detokenised on the host and scored
   by the `grpo.reward` functions, summed (`train.objectives.grpo_rewards`).
3. Advantages per group: `(r - mean) / (std + 1e-4)` (grpo; std with Bessel's correction,
   as TRL computes it) or `r - mean` (dr_grpo).
4. The loss per completion token, with `ratio = p / p_old`:

       -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A) + beta k3
       k3 = p_ref / p - log(p_ref / p) - 1        (the KL estimator of Schulman 2020)

   averaged over each completion's tokens, then over completions (grpo), or summed over
   its tokens and divided by `max_new_tokens` (dr_grpo). One update per rollout, so the
   old policy is the current one: `p_old` is `p` with its gradient stopped (the ratio is 1
   and the clip is inactive, as in TRL with one iteration); the log-probs are the
   teacher-forced ones at the sampling temperature.

The reference (for `beta` > 0) is the model the run starts from, as in preference
training: an adapted model's base (adapters zeroed) or the train state's frozen copy.

Evaluation draws one greedy completion per validation prompt: its `reward` (with
exact_match, the greedy accuracy) is the figure to watch. The metrics: `reward` and
`reward_std` (the groups' mean standard deviation), `accuracy` (the share of completions
with a positive reward), `kl`, `clip_fraction`, `completion_length`, and
`zero_std_groups` (the share of groups whose rewards are all equal: they teach nothing).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.errors import UserError
from train.objectives import grpo_rewards
from train.objectives.grpo_settings import GrpoSettings
from train.objectives.preference import (
    AgainstReference,
    joined_rows,
    reference_params,
    token_logprobs,
)
from train.objectives.sequence_candidates import Drawing, draw, row_keys

STD_EPS = 1e-4


def rollout_prompts(prompt_BP, prompt_seg_BP, bos_id: int):
    """Each prompt as the model reads it to continue it: its start token, then its pieces
    (the stored EOS dropped); (tokens `[B, P]`, lengths)."""
    pieces = jnp.sum(prompt_seg_BP > 0, axis=1) - 1
    shifted = jnp.pad(prompt_BP, ((0, 0), (1, 0)))[:, :-1]
    t = jnp.arange(prompt_BP.shape[1])[None, :]
    tokens = jnp.where(t == 0, bos_id, jnp.where(t <= pieces[:, None], shifted, 0))
    return tokens, pieces + 1


def prompt_records(dataset, tokenizer) -> dict[tuple[int, ...], dict]:
    """A local prompts dataset's lines by their prompts' pieces as the run encodes them
    (the rollout's prompt without its start and end tokens): {} for other data."""
    files = tuple(path for path, _ in getattr(dataset, "files", ()))
    if not files or dataset.kind != "prompts":
        return {}
    from train.data import kinds
    from train.data.local_files import read_prompt_records
    from train.data.pipeline.tokens import encode_side
    records = read_prompt_records(files)
    prompts = list(records)
    encoded = encode_side(tokenizer, prompts, kinds.PROMPTS.sides[0].role)
    return {tuple(ids[:-1]): records[p] for p, ids in zip(prompts, encoded, strict=True)}


def advantages(rewards_BG, *, scaled: bool):
    """Group-relative advantages and each group's standard deviation (Bessel's)."""
    mean = jnp.mean(rewards_BG, axis=1, keepdims=True)
    std = jnp.std(rewards_BG, axis=1, keepdims=True, ddof=1)
    centred = rewards_BG - mean
    return (centred / (std + STD_EPS) if scaled else centred), std[:, 0]


@dataclasses.dataclass(frozen=True)
class Grpo(AgainstReference):
    """GRPO (see the module docstring).

    Attributes:
        settings: the `grpo.*` keys.
        rewards: the host rewards (their functions and the tokenizer).
    """

    name = "grpo"
    reads_dataset = True
    WHOLE_LOSS = "GRPO's loss is its rewards'"
    READ = "each prompt"
    settings: GrpoSettings = dataclasses.field(default_factory=GrpoSettings)
    rewards: grpo_rewards.HostRewards | None = None

    @classmethod
    def build(cls, model_config, tokenizer, settings, *, model_name: str,
              dataset=None) -> Grpo:
        bos_id = cls.start_id(model_config, model_name=model_name)
        if tokenizer is None:
            raise UserError("GRPO's rewards read text: the run needs a tokenizer")
        fns = grpo_rewards.reward_functions(settings.grpo.reward)
        records = (prompt_records(dataset, tokenizer)
                   if any(grpo_rewards.takes_fields(fn) for fn in fns) else {})
        return cls(bos_id=bos_id, settings=settings.grpo,
                   rewards=grpo_rewards.HostRewards(fns, tokenizer, settings.grpo.reward,
                                                    records),
                   adapted=model_config.lora is not None)

    def init_inputs(self, row: dict) -> tuple[tuple, str | None]:
        return (row["inputs"],), None

    def prepare(self, batch: dict, *, key, row_ids) -> dict:
        """G weights a prompt (0 for an empty row), and each row's rollout key."""
        prompts_B = (batch["inputs_segmentation"][:, 0] > 0).astype(jnp.float32)
        return {"targets": batch["inputs"][:, 0],
                "weights": prompts_B * self.settings.num_generations,
                "row_keys": row_keys(key, row_ids)}

    def loss_sums(self, model, params, batch: dict, task: dict, *, dropout_rng, sample_rng,
                  step, train: bool, reference=None) -> dict:
        del dropout_rng, sample_rng, step
        s = self.settings
        G = s.num_generations if train else 1
        drawing = Drawing(candidates=G, temperature=s.temperature if train else 0.0,
                          top_k=s.top_k, max_new_tokens=s.max_new_tokens)
        prompts, lengths = rollout_prompts(batch["inputs"], batch["inputs_segmentation"],
                                           self.bos_id)
        tokens_BGN, lengths_BG = draw(model, params, prompts, lengths, task["row_keys"],
                                      drawing=drawing)
        B, _, N = tokens_BGN.shape
        tokens_MN, lengths_M = tokens_BGN.reshape(B * G, N), lengths_BG.reshape(B * G)
        answers_seg = batch["targets_segmentation"] > 0
        rewards_M = grpo_rewards.on_device(
            self.rewards, prompts[:, 1:], lengths - 1, tokens_MN, lengths_M, batch["targets"],
            jnp.sum(answers_seg, axis=1) - 1)
        rewards_BG = rewards_M.reshape(B, G)
        adv_BG, std_B = advantages(rewards_BG, scaled=s.loss == "grpo") if G > 1 else (
            jnp.zeros_like(rewards_BG), jnp.zeros((B,)))

        completion_seg = (jnp.arange(N)[None, :] < lengths_M[:, None]).astype(jnp.int32)
        rows, scored, real = joined_rows(
            jnp.repeat(batch["inputs"], G, axis=0),
            jnp.repeat(batch["inputs_segmentation"], G, axis=0), tokens_MN, completion_seg)
        logp = token_logprobs(model, params, rows, scored, real, bos_id=self.bos_id,
                              temperature=s.temperature)
        ratio = jnp.exp(logp - jax.lax.stop_gradient(logp))
        adv = adv_BG.reshape(B * G)[:, None]
        low, high = 1.0 - s.epsilon, 1.0 + s.clip_high
        per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, low, high) * adv)
        clipped = ((ratio < low) & (adv < 0)) | ((ratio > high) & (adv > 0))
        kl = jnp.zeros_like(logp)
        if s.needs_reference:
            if reference is None and not self.adapted:
                raise ValueError("a KL to the reference in full fine-tuning needs the train "
                                 "state's copy (TrainState.reference)")
            ref = jax.lax.stop_gradient(token_logprobs(
                model, reference_params(params, reference), rows, scored, real,
                bos_id=self.bos_id, temperature=s.temperature))
            kl = (jnp.exp(ref - logp) - (ref - logp) - 1.0) * scored
            per_token = per_token + s.beta * kl
        count = jnp.maximum(jnp.sum(scored, axis=1), 1.0)
        if s.loss == "grpo":
            per_completion = jnp.sum(per_token * scored, axis=1) / count
        else:
            per_completion = jnp.sum(per_token * scored, axis=1) / s.max_new_tokens
        valid_M = jnp.repeat(batch["inputs_segmentation"][:, 0] > 0, G).astype(jnp.float32)
        valid_B = (batch["inputs_segmentation"][:, 0] > 0).astype(jnp.float32)
        n = jnp.sum(valid_M)
        sums = {
            "loss": jnp.sum(per_completion * valid_M), "weight": n,
            "nll": jnp.sum(-jnp.sum(logp, axis=1) / count * valid_M),
            "correct": jnp.sum((rewards_M > 0) * valid_M),
            "reward": jnp.sum(rewards_M * valid_M), "reward_count": n,
            "kl": jnp.sum(jnp.sum(kl, axis=1) / count * valid_M), "kl_count": n,
            "completion_length": jnp.sum(lengths_M * valid_M), "completion_length_count": n}
        if train:              # evaluation draws one greedy completion: no group, no clip
            sums.update({
                "reward_std": jnp.sum(std_B * valid_B), "reward_std_count": jnp.sum(valid_B),
                "clip_fraction": jnp.sum(jnp.sum(clipped * scored, axis=1) * valid_M),
                "clip_fraction_count": jnp.sum(jnp.sum(scored, axis=1) * valid_M),
                "zero_std_groups": jnp.sum((std_B == 0) * valid_B),
                "zero_std_groups_count": jnp.sum(valid_B)})
        return sums
