"""SamplingParams: what a request asks of the sampler. Greedy (temperature 0) is first-class."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dsinfer.structured.spec import StructuredOutputs

_MAX_LOGPROBS = 20
# Seeds are int64 (OpenAI's range; torch.Generator takes no more).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


@dataclass(slots=True)
class SamplingParams:
    """Per-request decoding controls, validated on construction (ValueError names the field).

    n (1): samples per prompt (sample i uses seed + i when seeded). max_tokens (16; None: up
    to the context). min_tokens (0): end-of-text and stop token ids are ignored before it.
    temperature (1.0; below 1e-5 is greedy), top_p (1.0), top_k (-1: off), min_p (0.0):
    the usual filters, applied after the penalties. repetition_penalty (1.0: prompt and output
    tokens, multiplicative), frequency_penalty / presence_penalty (0.0, OpenAI's, output
    only). seed (None: drawn from the engine's seed stream, so runs are reproducible).
    stop (strings; never shown unless include_stop_str_in_output), stop_token_ids.
    ignore_eos (False): go on past end-of-text (benchmarks). logprobs (None, or 0..20 top
    alternatives per token), prompt_logprobs (same, for the prompt). skip_special_tokens
    (True): special tokens left out of the text. logit_bias ({}): token id → bias added to
    the logits, [-100, 100]. structured (None): a JSON schema, regex, choice or grammar the
    output must match (dsinfer.structured.StructuredOutputs). prediction (None): text (or its
    token ids) the output is expected to repeat mostly (OpenAI's predicted outputs: a file or record with a
    few edits); its tokens are drafted and verified, so the output is exactly what it would
    be without it, only sooner where the prediction is right. truncate_prompt_tokens (None):
    keep only the prompt's last k tokens (vLLM's left truncation; the start of a chat's
    rendered prompt, its system turn included, is what goes).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # OpenAI semantics: token id → bias in [-100, 100] added to that token's logit before
    # sampling (and before logprobs, so -100 shows the token as banned).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Constrained decoding: the output must match this (JSON schema, regex, choice, grammar).
    structured: StructuredOutputs | None = None
    prediction: str | list[int] | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        _check(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _check(
            self.max_tokens is None or self.max_tokens >= 0,
            "max_tokens",
            f"must be >= 0, got {self.max_tokens}",
        )
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        _check(
            0.0 <= self.temperature <= 2.0 or self.temperature == 0,
            "temperature",
            f"must be in [0, 2], got {self.temperature}",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(
            self.top_k == -1 or self.top_k >= 1, "top_k", f"must be -1 or >= 1, got {self.top_k}"
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        for tok, bias in self.logit_bias.items():
            _check(
                tok >= 0 and -100.0 <= bias <= 100.0,
                "logit_bias",
                f"needs token ids >= 0 and biases in [-100, 100], got {tok}: {bias}",
            )
        _check(
            self.seed is None or SEED_MIN <= self.seed <= SEED_MAX,
            "seed",
            f"must be a 64-bit signed integer, got {self.seed}",
        )
        _check(
            self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1,
            "truncate_prompt_tokens",
            f"must be >= 1, got {self.truncate_prompt_tokens}",
        )
        _check(
            self.prediction is None
            or isinstance(self.prediction, str)
            or all(isinstance(t, int) for t in self.prediction),
            "prediction",
            f"must be text or token ids, got {type(self.prediction).__name__}",
        )
        if self.structured is not None:
            # The grammar decides where the output ends (only end-of-turn tokens are allowed
            # once it is complete): a rule that hides or delays those tokens would break it.
            _check(not self.ignore_eos, "ignore_eos", "cannot be combined with structured outputs")
            _check(self.min_tokens == 0, "min_tokens", "cannot be combined with structured outputs")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(
                v is None or 0 <= v <= _MAX_LOGPROBS,
                name,
                f"must be between 0 and {_MAX_LOGPROBS}, got {v}",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


def truncated_prompt(ids: list[int], keep: int | None) -> list[int]:
    """The prompt's ids as a request runs them: the last `keep` (truncate_prompt_tokens), or
    all of them when it is None."""
    return ids if keep is None or len(ids) <= keep else ids[-keep:]


def split_samples(params: SamplingParams, n: int | None = None) -> list[SamplingParams]:
    """n independent single-sample requests for one prompt; sample i uses seed + i when seeded,
    so the n answers differ yet a seeded request stays reproducible. n defaults to params.n."""
    n = params.n if n is None else n
    if n == 1 and params.n == 1:
        return [params]
    if params.seed is not None and params.seed + n - 1 > SEED_MAX:
        raise InvalidSamplingParameter(
            "seed", f"{params.seed} with n={n} derives seeds past {SEED_MAX}; use a smaller seed"
        )
    return [
        dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
        for i in range(n)
    ]


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    """ValueError naming the first few ids outside [0, vocab_size)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


class InvalidSamplingParameter(ValueError):
    """A sampling parameter out of its range; `param` names it (the server's error body)."""

    def __init__(self, param: str, why: str) -> None:
        super().__init__(f"invalid sampling parameter {param}: {why}")
        self.param = param


def _check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise InvalidSamplingParameter(name, why)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """What sampling reports of one chosen token when logprobs were asked: its log-probability
    and rank under the raw model distribution, and the top-n alternatives as (token id,
    logprob). A public output type (CompletionOutput.logprobs, the server's logprobs); the
    worker makes it, the engine and server pass it on."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]
