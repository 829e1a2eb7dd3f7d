"""SamplingParams and StructuredOutputs: how one request is sampled, validated once, with
`ValueError` naming the field (a row's bad field fails that row only)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from cbgen.option_checks import check, check_int, check_num

MAX_LOGPROBS = 20
"""The most top entries per token that logprobs / prompt_logprobs may ask for (vLLM's and
OpenAI's limit)."""

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on a completion (vLLM's structured outputs): exactly one field is set.
    Whether it compiles is the engine's check (a schema it cannot compile fails that row)."""

    json: dict[str, Any] | str | None = None
    """A JSON schema (an object, or its JSON text): the completion is one JSON value of it."""
    regex: str | None = None
    """The completion fully matches this regular expression."""
    choice: list[str] | None = None
    """The completion is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF (GBNF) grammar whose root rule the completion derives."""
    json_object: bool = False
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""

    def __post_init__(self) -> None:
        name = "structured_outputs"
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        check(
            len(given) == 1,
            name,
            f"give exactly one of {', '.join(STRUCTURED_KINDS)}, got "
            + (" and ".join(given) if given else "none"),
        )
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"{name}: json: not valid JSON ({e})") from None
            check(isinstance(schema, dict), name, "json: the schema must be a JSON object")
        check(
            self.json is None or isinstance(self.json, (dict, str)),
            name,
            f"json: must be a schema object or its JSON text, got {self.json!r}",
        )
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            check(
                value is None or (isinstance(value, str) and bool(value)),
                name,
                f"{kind}: must be a non-empty string, got {value!r}",
            )
        check(isinstance(self.json_object, bool), name, "json_object: must be true or false")
        if self.choice is not None:
            check(
                isinstance(self.choice, Sequence)
                and not isinstance(self.choice, str)
                and len(self.choice) > 0
                and all(isinstance(c, str) and c for c in self.choice),
                name,
                f"choice: must be a non-empty list of non-empty strings, got {self.choice!r}",
            )
            object.__setattr__(self, "choice", list(self.choice))

    @classmethod
    def coerce(cls, value: object) -> StructuredOutputs:
        """From a row's JSON object ({"regex": "..."}); ValueError naming an unknown key."""
        if isinstance(value, cls):
            return value
        check(
            isinstance(value, dict),
            "structured_outputs",
            f"must be an object with one of {', '.join(STRUCTURED_KINDS)}, got {value!r}",
        )
        spec = cast(dict[str, Any], value)
        unknown = sorted(set(spec) - set(STRUCTURED_KINDS))
        check(
            not unknown,
            "structured_outputs",
            f"unknown field {unknown[0] if unknown else ''!r} "
            f"(give one of {', '.join(STRUCTURED_KINDS)})",
        )
        return cls(**{k: v for k, v in spec.items() if v is not None})

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): equal for equal constraints; the compiled-grammar cache's key."""
        value = getattr(self, self.kind)
        if isinstance(value, str):
            return self.kind, value
        return self.kind, json.dumps(value, ensure_ascii=False)  # key order is field order


@dataclass
class SamplingParams:
    """How to sample one request. temperature=0 is greedy."""

    n: int = 1
    """Completions per prompt."""
    max_tokens: int = 16
    """Most tokens to generate."""
    min_tokens: int = 0
    """EOS and stop token ids are held back until this many tokens exist."""
    temperature: float = 1.0
    top_k: int = 0
    """0 (or -1) keeps every token."""
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    """Seeds this request's own generator, in [0, 2**64); None: derived from the engine seed."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; left out of the returned text."""
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    """Go on past EOS (EOS is not masked, it just does not stop generation)."""
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    """Log-probability of each generated token and of this many top alternatives (0: the
    token's own only); None: none. The model's log-softmax in float32, before temperature,
    penalties and top-k / top-p / min-p."""
    prompt_logprobs: int | None = None
    """The same for each prompt token after the first (which has none); None: none. Such a
    request takes no prefix-cache hits: every prompt position is computed."""
    logit_bias: dict[int, float] | None = None
    """Added to these token ids' logits before sampling; OpenAI's string keys ("123") are
    taken as ids, values are clamped to [-100, 100] as OpenAI does."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids may be sampled; None: any."""
    bad_words: list[str] = field(default_factory=list)
    """Words never generated: each word's token sequence (tokenized as given and after a
    space) never appears in the output; its last token is masked wherever the output ends
    with the tokens before it."""
    structured_outputs: StructuredOutputs | None = None
    """A constraint the completion follows (JSON schema, regex, choice or grammar); rows give
    it as an object ({"regex": "..."}) or as OpenAI's response_format. None: free text."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        check(
            isinstance(self.stop, Sequence),
            "stop",
            f"must be a string or a list of strings, got {self.stop!r}",
        )
        self.stop = list(self.stop)
        check(
            isinstance(self.stop_token_ids, Sequence) and not isinstance(self.stop_token_ids, str),
            "stop_token_ids",
            f"must be a list of token ids, got {self.stop_token_ids!r}",
        )
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        check_int(self.n, "n")
        check(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        check_int(self.max_tokens, "max_tokens")
        check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        check_int(self.min_tokens, "min_tokens")
        check(
            0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
        )
        check_num(self.temperature, "temperature")
        check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        check_int(self.top_k, "top_k")
        check(self.top_k >= 0, "top_k", f"must be >= 0 (or -1 for all), got {self.top_k}")
        check_num(self.top_p, "top_p")
        check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        check_num(self.min_p, "min_p")
        check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            check_int(self.seed, "seed")
            # the range a torch.Generator accepts without overflow
            check(0 <= self.seed < 2**64, "seed", f"must be in [0, 2**64), got {self.seed}")
        check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be non-empty strings",
        )
        check(
            all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.stop_token_ids
            ),
            "stop_token_ids",
            "must be non-negative integers",
        )
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be true or false")
        check_num(self.repetition_penalty, "repetition_penalty")
        check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        check_num(self.presence_penalty, "presence_penalty")
        check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        check_num(self.frequency_penalty, "frequency_penalty")
        check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None:
                check_int(k, name)
                check(
                    0 <= k <= MAX_LOGPROBS,
                    name,
                    f"must be in [0, {MAX_LOGPROBS}] (top entries per token), got {k}",
                )
        self._check_logit_controls()
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputs.coerce(self.structured_outputs)

    def _check_logit_controls(self) -> None:
        """logit_bias to {int: float} with clamped values; allowed_token_ids and bad_words to
        lists. Whether the ids are in the vocabulary is the engine's check."""
        if self.logit_bias is not None:
            check(
                isinstance(self.logit_bias, dict),
                "logit_bias",
                f"must be an object of token id -> bias, got {self.logit_bias!r}",
            )
            bias = {}
            for key, value in self.logit_bias.items():
                token = _token_id_key(key)
                check(token is not None, "logit_bias", f"key {key!r} is not a token id")
                check_num(value, "logit_bias")
                bias[cast(int, token)] = min(max(float(value), -100.0), 100.0)
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            check(
                isinstance(self.allowed_token_ids, Sequence)
                and not isinstance(self.allowed_token_ids, str)
                and len(self.allowed_token_ids) > 0
                and all(_is_token_id(t) for t in self.allowed_token_ids),
                "allowed_token_ids",
                f"must be a non-empty list of token ids, got {self.allowed_token_ids!r}",
            )
            self.allowed_token_ids = list(self.allowed_token_ids)
        check(
            isinstance(self.bad_words, Sequence)
            and not isinstance(self.bad_words, str)
            and all(isinstance(w, str) and w.strip() for w in self.bad_words),
            "bad_words",
            f"must be a list of non-blank strings, got {self.bad_words!r}",
        )
        self.bad_words = list(self.bad_words)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def has_logit_controls(self) -> bool:
        """Whether logit_bias, allowed_token_ids or bad_words can change this row's logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _token_id_key(key: object) -> int | None:
    """A logit_bias key as a token id: an int, or a string of decimal digits (OpenAI's JSON
    object keys); None if it is neither."""
    if isinstance(key, str) and key.strip().isdecimal():
        return int(key)
    return cast(int, key) if _is_token_id(key) else None
