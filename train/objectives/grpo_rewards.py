"""GRPO's rewards, computed on the host: detokenise each prompt, completion and answer,
score every completion of the batch with the `grpo.reward` functions, summed.

    fns = reward_functions("exact_match,number")
    rewards = HostRewards(fns, tokenizer, "exact_match,number")
    rewards(prompt_tokens_BP, prompt_lengths_B, tokens_MN, lengths_M, answer_tokens_BA,
            answer_lengths_B)                                  # float32[M], M = B x G
    on_device(rewards, ...)                                    # the same from traced arrays

A reward function takes the batch's lists `(prompts, completions, answers)` (completion m
answers prompt m // G) and returns a float per completion; one that also takes a `fields`
keyword gets each completion's prompt line as a dict, every field of its JSON object
(`local_prompts` data: `{"prompt", "answer", "tests": [...], ...}`; a generated dataset's:
its prompt and answer). The built-ins: `exact_match`,
1.0 when the completion (stripped) equals the answer (stripped); `number`, 1.0 when the
completion is a decimal number (a format check). A value that is not a finite number is
refused, naming the completion and its prompt.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from models.errors import UserError, raise_from_host
from train.objectives import sequence_rewards

KEY = "grpo.reward"
_NUMBER = re.compile(r"-?\d+(\.\d+)?")


def exact_match(prompts, completions, answers) -> list[float]:
    del prompts
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answers, strict=True)]


def number(prompts, completions, answers) -> list[float]:
    del prompts, answers
    return [float(_NUMBER.fullmatch(c.strip()) is not None) for c in completions]


BUILT_IN = {"exact_match": exact_match, "number": number}


def reward_functions(names: str) -> tuple[Callable, ...]:
    """The functions `grpo.reward` names (comma-separated built-ins or "module:function").

    Raises:
        UserError: a module that does not import, or has no such callable (named, with
            the name as written).
    """
    return tuple(sequence_rewards.reward_function(n.strip(), built_in=BUILT_IN, key=KEY)
                 for n in names.split(","))


def takes_fields(fn) -> bool:
    """Whether a reward function takes the prompts' lines (a `fields` keyword)."""
    try:
        return "fields" in inspect.signature(fn).parameters
    except (TypeError, ValueError):           # a builtin without a signature
        return False


def score(fns, prompts: list[str], completions: list[str], answers: list[str],
          fields: list[dict] | None = None, *, name: str = "") -> np.ndarray:
    """float32 summed rewards of each completion (completion m answers prompt m // G);
    `fields`, each prompt's line (default: its prompt and answer), goes to the functions
    that take it.

    Raises:
        UserError: a function that returns the wrong number of values, or a value that is
            not a finite number, naming the completion and its prompt.
    """
    groups = len(completions) // max(len(prompts), 1)
    if fields is None:
        fields = [{"prompt": p, "answer": a} for p, a in zip(prompts, answers, strict=True)]
    each_prompt = [prompts[m // groups] for m in range(len(completions))]
    each_answer = [answers[m // groups] for m in range(len(completions))]
    each_fields = [fields[m // groups] for m in range(len(completions))]
    total = np.zeros(len(completions), np.float32)
    for fn in fns:
        extra = {"fields": each_fields} if takes_fields(fn) else {}
        values = list(fn(each_prompt, list(completions), each_answer, **extra))
        if len(values) != len(completions):
            raise UserError(f"{KEY}={name!r}: {getattr(fn, '__name__', fn)} gave "
                            f"{len(values)} rewards for {len(completions)} completions")
        for m, value in enumerate(values):
            try:
                x = float(value)
            except (TypeError, ValueError):
                x = math.nan
            if isinstance(value, bool) or not math.isfinite(x):
                raise UserError(f"{KEY}={name!r} gave {value!r} for the completion "
                                f"{completions[m]!r} of the prompt {each_prompt[m]!r}: a "
                                "reward must be a finite number")
            total[m] += x
    return total


@dataclasses.dataclass(frozen=True)
class HostRewards:
    """The summed rewards of token completions, on the host.

    Attributes:
        fns: the reward functions.
        tokenizer: detokenises prompts, completions and answers (up to the end token).
        name: the `grpo.reward` value, for messages.
    """

    fns: tuple = dataclasses.field(compare=False, hash=False)
    tokenizer: object = dataclasses.field(compare=False, hash=False)
    name: str = ""
    records: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def texts(self, tokens, lengths) -> list[str]:
        tokens, lengths = np.asarray(tokens), np.asarray(lengths)
        return [self.tokenizer.decode(row[:n].tolist()) for row, n in zip(tokens, lengths,
                                                                          strict=True)]

    def fields(self, prompts_BP, prompt_lengths_B, prompts: list[str], answers: list[str]):
        """Each prompt's line (`records`, keyed by the prompt's pieces), or its prompt and
        answer where the data has no lines (a generated dataset)."""
        if not self.records or not any(takes_fields(fn) for fn in self.fns):
            return None
        out = []
        for row, n, text in zip(np.asarray(prompts_BP), np.asarray(prompt_lengths_B),
                                prompts, strict=True):
            record = self.records.get(tuple(row[:n].tolist()))
            if record is None:
                raise UserError(f"{KEY}={self.name!r}: the prompt {text!r} is no line of the "
                                "data files as encoded (cut to max_source_length?): its "
                                "fields cannot be found; raise max_source_length")
            out.append(record)
        return out

    def __call__(self, prompts_BP, prompt_lengths_B, tokens_MN, lengths_M, answers_BA,
                 answer_lengths_B):
        try:
            prompts = self.texts(prompts_BP, prompt_lengths_B)
            answers = self.texts(answers_BA, answer_lengths_B)
            return score(self.fns, prompts, self.texts(tokens_MN, lengths_M), answers,
                         self.fields(prompts_BP, prompt_lengths_B, prompts, answers),
                         name=self.name)
        except UserError as e:          # inside the step: the command line reports it
            raise_from_host(e)


def on_device(rewards: HostRewards, *arrays) -> jax.Array:
    """`rewards(*arrays)` from traced arrays through `jax.pure_callback`: float32[M]."""
    shape = jax.ShapeDtypeStruct((arrays[2].shape[0],), jnp.float32)
    out = jax.pure_callback(rewards, shape, *arrays, vmap_method="sequential")
    return jax.lax.stop_gradient(out)
