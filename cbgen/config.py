"""EngineConfig and SamplingParams: plain dataclasses, validated once, with `ValueError`.

What is discovered at run time (number of KV blocks, EOS id, the resolved device) lives in
the engine, not here: a config says what the user asked for.

Longer than 400 lines: one job, the user's options (every CLI option maps onto a field here,
cli_options reads them), each field documented and validated once, naming the field; the
engine's options and a request's stay side by side so that their checks read alike.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

DEFAULT_MODEL = "smollm2-135m-instruct"
MAX_LOGPROBS = 20
"""The most top entries per token that logprobs / prompt_logprobs may ask for (vLLM's and
OpenAI's limit)."""

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
CpuWeightDtype = Literal["auto", "float32", "bfloat16", "float16"]
KvCacheDtype = Literal["auto", "float32", "bfloat16"]
Device = Literal["auto", "cpu", "cuda"]
AttentionBackendName = Literal["auto", "torch", "cpu", "triton", "flash"]
LoadFormat = Literal["auto", "dummy"]
SchedulingPolicy = Literal["continuous", "static"]


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option, with its default. CLI options map one to one onto these fields."""

    model: str | None = None
    """Local Hugging Face folder, GGUF file, Hub id (org/name, or org/name:file.gguf) from the
    local cache or downloaded, built-in shape name (with load_format='dummy'), or None for the
    default SmolLM2-135M-Instruct."""
    revision: str | None = None
    """Branch, tag or commit of a Hub id (default: main)."""
    download_dir: str | None = None
    """Hugging Face cache folder for Hub ids (default: the cache under HF_HOME)."""
    max_num_seqs: int = 64
    """Slots: the most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decodes)."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so decodes keep flowing."""
    block_size: int = 16
    """Tokens per KV cache block."""
    kv_cache_memory: int | None = None
    """KV cache size in bytes. None: on the CPU a quarter of available memory, at most 4 GiB;
    on CUDA sized from gpu_memory_utilization."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use (weights, activations and KV cache)."""
    max_model_len: int | None = None
    """Longest prompt + output. None: the model's own limit."""
    dtype: Dtype = "auto"
    """Weights and activations: auto is float32 on the CPU, bfloat16 on CUDA."""
    cpu_weight_dtype: CpuWeightDtype = "auto"
    """On the CPU in float32: the dtype the weights are kept in. bfloat16 or float16 keep
    them in half the memory of float32 (a sixth of float32 with its packed copies), each
    matmul upcasting its weight as it runs, while activations, norms, attention and the KV
    cache stay float32 (slower; the same tokens as float32 on those weights). auto: float32,
    or the checkpoint's own bf16/fp16 when its float32 copy would not fit in memory."""
    kv_cache_dtype: KvCacheDtype = "auto"
    """On the CPU: the KV cache's dtype. bfloat16 holds twice the tokens of float32 in the same
    memory (attention reads rounded K and V: not token-exact against transformers); float32
    keeps them exact under --dtype bfloat16. auto: bfloat16 under --dtype bfloat16, else the
    activations' dtype."""
    device: Device = "auto"
    """auto picks CUDA when available."""
    attention_backend: AttentionBackendName = "auto"
    """auto: flash when vllm_flash_attn imports, else triton on CUDA; cpu on the CPU (the C
    kernels). torch is the plain reference, on any device."""
    load_format: LoadFormat = "auto"
    """dummy: random weights for the model's shape (benchmarks without weights)."""
    dequantize: bool = False
    """A GGUF file's quantized tensors dequantized to float on load (the path token-exact
    against transformers), instead of run in their blocks (the default on the CPU, as llama.cpp
    runs them: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; other types are dequantized,
    and the start-up line says which)."""
    seed: int = 0
    """Seed for dummy weights and for sampling requests that give no seed of their own;
    in [0, 2**32)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes seen before."""
    scheduling_policy: SchedulingPolicy = "continuous"
    """continuous (iteration-level) or static (request-level, for comparison)."""
    static_batch_size: int = 8
    """Batch size of the static policy."""
    num_threads: int | None = None
    """CPU threads for torch. None: every core this process may use."""
    enforce_eager: bool = False
    """Run every step eagerly. Otherwise, on CUDA with the triton attention backend, decode-only
    steps replay CUDA graphs captured at start-up, one per batch-size bucket."""

    def __post_init__(self) -> None:
        # types first, so that a wrong type is a ValueError naming the field, not a TypeError
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "static_batch_size"):
            _int(getattr(self, name), name)
        for name in ("kv_cache_memory", "max_model_len", "num_threads"):
            if getattr(self, name) is not None:
                _int(getattr(self, name), name)
        for name in (
            "enable_chunked_prefill",
            "enable_prefix_caching",
            "enforce_eager",
            "dequantize",
        ):
            _check(isinstance(getattr(self, name), bool), name, "must be true or false")
        _num(self.gpu_memory_utilization, "gpu_memory_utilization")
        _check(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _check(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            f"must be >= 1, got {self.max_num_batched_tokens}",
        )
        _check(
            self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
            "block_size",
            f"must be a power of two, got {self.block_size}",
        )
        _check(
            self.kv_cache_memory is None or self.kv_cache_memory > 0,
            "kv_cache_memory",
            f"must be > 0 bytes, got {self.kv_cache_memory}",
        )
        _check(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            f"must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _check(
            self.max_model_len is None or self.max_model_len >= 1,
            "max_model_len",
            f"must be >= 1, got {self.max_model_len}",
        )
        _choice(self.dtype, "dtype", ("auto", "float32", "bfloat16", "float16"))
        _choice(self.device, "device", ("auto", "cpu", "cuda"))
        _choice(self.cpu_weight_dtype, "cpu_weight_dtype", get_args(CpuWeightDtype))
        _check(
            self.cpu_weight_dtype == "auto"
            or (self.dtype in ("auto", "float32") and self.device != "cuda"),
            "cpu_weight_dtype",
            f"applies to float32 on the CPU, not to dtype {self.dtype} on device {self.device}",
        )
        _choice(self.kv_cache_dtype, "kv_cache_dtype", get_args(KvCacheDtype))
        _check(
            self.kv_cache_dtype == "auto" or self.device != "cuda",
            "kv_cache_dtype",
            f"applies to the CPU, not to device {self.device}",
        )
        _choice(self.attention_backend, "attention_backend", get_args(AttentionBackendName))
        _choice(self.load_format, "load_format", ("auto", "dummy"))
        _choice(self.scheduling_policy, "scheduling_policy", ("continuous", "static"))
        _check(
            self.static_batch_size >= 1,
            "static_batch_size",
            f"must be >= 1, got {self.static_batch_size}",
        )
        _int(self.seed, "seed")
        _check(0 <= self.seed < 2**32, "seed", f"must be in [0, 2**32), got {self.seed}")
        for name in ("revision", "download_dir"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, str) and bool(value.strip())),
                name,
                f"must be a non-empty string, got {value!r}",
            )
        _check(
            self.num_threads is None or self.num_threads >= 1,
            "num_threads",
            f"must be >= 1, got {self.num_threads}",
        )

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _choice(value: object, name: str, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, name, f"must be one of {', '.join(allowed)}; got {value!r}")


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
        _check(
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
            _check(isinstance(schema, dict), name, "json: the schema must be a JSON object")
        _check(
            self.json is None or isinstance(self.json, (dict, str)),
            name,
            f"json: must be a schema object or its JSON text, got {self.json!r}",
        )
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            _check(
                value is None or (isinstance(value, str) and bool(value)),
                name,
                f"{kind}: must be a non-empty string, got {value!r}",
            )
        _check(isinstance(self.json_object, bool), name, "json_object: must be true or false")
        if self.choice is not None:
            _check(
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
        _check(
            isinstance(value, dict),
            "structured_outputs",
            f"must be an object with one of {', '.join(STRUCTURED_KINDS)}, got {value!r}",
        )
        spec = cast(dict[str, Any], value)
        unknown = sorted(set(spec) - set(STRUCTURED_KINDS))
        _check(
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
        _check(
            isinstance(self.stop, Sequence),
            "stop",
            f"must be a string or a list of strings, got {self.stop!r}",
        )
        self.stop = list(self.stop)
        _check(
            isinstance(self.stop_token_ids, Sequence) and not isinstance(self.stop_token_ids, str),
            "stop_token_ids",
            f"must be a list of token ids, got {self.stop_token_ids!r}",
        )
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        _int(self.n, "n")
        _check(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _int(self.max_tokens, "max_tokens")
        _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _int(self.min_tokens, "min_tokens")
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
        )
        _num(self.temperature, "temperature")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _int(self.top_k, "top_k")
        _check(self.top_k >= 0, "top_k", f"must be >= 0 (or -1 for all), got {self.top_k}")
        _num(self.top_p, "top_p")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _num(self.min_p, "min_p")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _int(self.seed, "seed")
            # the range a torch.Generator accepts without overflow
            _check(0 <= self.seed < 2**64, "seed", f"must be in [0, 2**64), got {self.seed}")
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be non-empty strings",
        )
        _check(
            all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.stop_token_ids
            ),
            "stop_token_ids",
            "must be non-negative integers",
        )
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be true or false")
        _num(self.repetition_penalty, "repetition_penalty")
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        _num(self.presence_penalty, "presence_penalty")
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _num(self.frequency_penalty, "frequency_penalty")
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None:
                _int(k, name)
                _check(
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
            _check(
                isinstance(self.logit_bias, dict),
                "logit_bias",
                f"must be an object of token id -> bias, got {self.logit_bias!r}",
            )
            bias = {}
            for key, value in self.logit_bias.items():
                token = _token_id_key(key)
                _check(token is not None, "logit_bias", f"key {key!r} is not a token id")
                _num(value, "logit_bias")
                bias[cast(int, token)] = min(max(float(value), -100.0), 100.0)
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            _check(
                isinstance(self.allowed_token_ids, Sequence)
                and not isinstance(self.allowed_token_ids, str)
                and len(self.allowed_token_ids) > 0
                and all(_is_token_id(t) for t in self.allowed_token_ids),
                "allowed_token_ids",
                f"must be a non-empty list of token ids, got {self.allowed_token_ids!r}",
            )
            self.allowed_token_ids = list(self.allowed_token_ids)
        _check(
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


def _int(value: object, name: str) -> None:
    _check(
        isinstance(value, int) and not isinstance(value, bool),
        name,
        f"must be an integer, got {value!r}",
    )


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _token_id_key(key: object) -> int | None:
    """A logit_bias key as a token id: an int, or a string of decimal digits (OpenAI's JSON
    object keys); None if it is neither."""
    if isinstance(key, str) and key.strip().isdecimal():
        return int(key)
    return cast(int, key) if _is_token_id(key) else None


def _num(value: object, name: str) -> None:
    _check(
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
        name,
        f"must be a finite number, got {value!r}",
    )


# ---- sizes ------------------------------------------------------------------------------

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}  # fmt: skip


def parse_size(text: str) -> int:
    """'4GiB' -> 4294967296; KiB/MiB/GiB/TiB (and K/M/G/T) are binary, KB/MB/GB/TB decimal,
    a plain number is bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"kv_cache_memory: expected a size such as 4GiB, 512MiB or 1000000 (bytes), got {text!r}"
        )
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"kv_cache_memory: must be > 0 bytes, got {text!r}")
    return value
