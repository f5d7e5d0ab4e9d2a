"""Rewards of whole sequences, computed on the host: detokenise each candidate and its
source's reference, score the pair with a function of two strings.

    fn = reward_function("chrf")            # sacrebleu's sentence chrF / 100
    fn = reward_function("my_rewards:exact") # my_rewards.exact(hypothesis, reference)
    rewards = HostRewards(fn, tokenizer, "chrf")
    rewards(cand_tokens_MW, cand_lengths_M, ref_tokens_BT, ref_lengths_B)   # float32[M]
    on_device(rewards, cand_tokens_MW, ...)     # the same from traced arrays

The built-in rewards are sacrebleu's sentence BLEU and chrF divided by 100 (so in [0, 1],
as the cost 1 - reward of `train.objectives.sequence_risk` expects). A user's function may
return any finite number: a constant shift changes neither minimum risk training's
gradient (the candidates' weights sum to 1) nor self-critical REINFORCE's (the greedy
baseline shifts too). A reward that is not a finite number is refused, naming the value,
the candidate and the reference.

Inside the jitted train step `on_device` is a `jax.pure_callback` (each device's rows on
pmap and shard_map, the whole batch under the sharded mesh's jit): the rewards are a
deterministic function of the tokens, so they are the same wherever the rows are.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from models.errors import UserError, raise_from_host

KEY = "sequence.reward"


def _bleu(hypothesis: str, reference: str) -> float:
    import sacrebleu
    return sacrebleu.sentence_bleu(hypothesis, [reference]).score / 100.0


def _chrf(hypothesis: str, reference: str) -> float:
    import sacrebleu
    return sacrebleu.sentence_chrf(hypothesis, [reference]).score / 100.0


BUILT_IN = {"bleu": _bleu, "chrf": _chrf}


def reward_function(name: str, *, built_in=None, key: str = KEY) -> Callable:
    """The reward `name` names: one of `built_in` (None: "bleu", "chrf") or
    "module:function" (imported; the module must be importable, from the working directory
    or PYTHONPATH). `key` is the config key the messages name (GRPO's rewards load here
    too, with their own built-ins).

    Raises:
        UserError: the module does not import, or has no such callable (named).
    """
    built_in = BUILT_IN if built_in is None else built_in
    if name in built_in:
        return built_in[name]
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name.strip())
    except ImportError as e:
        raise UserError(f"{key}={name!r}: cannot import module {module_name.strip()!r} "
                        f"({e})") from None
    fn = getattr(module, attr.strip(), None)
    if not callable(fn):
        raise UserError(f"{key}={name!r}: module {module_name.strip()!r} has no function "
                        f"{attr.strip()!r}")
    return fn


def score(fn: Callable[[str, str], float], hypotheses: list[str], references: list[str],
          *, name: str = "") -> np.ndarray:
    """float32 rewards of each (hypothesis, reference) pair.

    Raises:
        UserError: a reward that is not a finite number, naming it, the candidate and the
            reference.
    """
    out = np.zeros(len(hypotheses), np.float32)
    for i, (h, r) in enumerate(zip(hypotheses, references, strict=True)):
        value = fn(h, r)
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if isinstance(value, bool) or not math.isfinite(number):
            raise UserError(f"{KEY}={name!r} gave {value!r} for the candidate {h!r} "
                            f"(reference {r!r}): a reward must be a finite number")
        out[i] = number
    return out


@dataclasses.dataclass(frozen=True)
class HostRewards:
    """The reward of token candidates against token references, on the host.

    Attributes:
        fn: f(hypothesis, reference) -> float.
        tokenizer: detokenises both (`decode`: target side, up to the end token).
        name: the `sequence.reward` value, for messages.
    """

    fn: Callable[[str, str], float] = dataclasses.field(compare=False, hash=False)
    tokenizer: object = dataclasses.field(compare=False, hash=False)
    name: str = ""

    def texts(self, tokens, lengths) -> list[str]:
        """Each row's first `length` tokens, detokenised."""
        tokens, lengths = np.asarray(tokens), np.asarray(lengths)
        return [self.tokenizer.decode(row[:n].tolist()) for row, n in zip(tokens, lengths,
                                                                          strict=True)]

    def __call__(self, cand_tokens_MW, cand_lengths_M, ref_tokens_BT, ref_lengths_B):
        """float32[M] rewards of M = B x K candidates, candidate m of source m // K."""
        hyps = self.texts(cand_tokens_MW, cand_lengths_M)
        refs = self.texts(ref_tokens_BT, ref_lengths_B)
        per_source = len(hyps) // max(len(refs), 1)
        try:
            return score(self.fn, hyps, [refs[m // per_source] for m in range(len(hyps))],
                         name=self.name)
        except UserError as e:          # inside the step: the command line reports it
            raise_from_host(e)


def on_device(rewards: HostRewards, cand_tokens_MW, cand_lengths_M, ref_tokens_BT,
              ref_lengths_B) -> jax.Array:
    """`rewards(...)` from traced arrays, through `jax.pure_callback`: float32[M], no
    gradient."""
    shape = jax.ShapeDtypeStruct((cand_tokens_MW.shape[0],), jnp.float32)
    out = jax.pure_callback(rewards, shape, cand_tokens_MW, cand_lengths_M, ref_tokens_BT,
                            ref_lengths_B, vmap_method="sequential")
    return jax.lax.stop_gradient(out)
