"""Compare the grammar engines cbgen could use for structured outputs, on a real tokenizer.

    python -m tools.grammar_engines [--model PATH] [--repeat 5]

For each engine (xgrammar, llguidance, outlines-core; those that import) and each constraint
(a JSON schema, a regex, a choice) it prints the compile time (tokenizer set-up apart) and the
cost per generated token of what the sampler does each step: fill the next-token bitmask, then
accept the token. The tokens walked are the tokenizer's own encoding of a valid answer.
Without --model: SmolLM2-135M-Instruct's tokenizer.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}
SCHEMA_ANSWER = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "tags": ["mathematics", "poetry", "engines"],
        "address": {"city": "London", "zip": "W1"},
    },
    separators=(", ", ": "),
)
REGEX = r"(\d{3}-\d{3}-\d{4}|[A-Z][a-z]+ [A-Z][a-z]+, [a-z]+@[a-z]+\.(com|org))"
REGEX_ANSWER = "Grace Hopper, grace@navy.org"
CHOICES = ["positive", "negative", "neutral", "mixed feelings"]
CHOICE_ANSWER = "mixed feelings"
CASES = {
    "json_schema": ("schema", SCHEMA_ANSWER),
    "regex": ("regex", REGEX_ANSWER),
    "choice": ("choice", CHOICE_ANSWER),
}


def choice_regex(choices: list[str]) -> str:
    """An alternation of the literal strings (only regex metacharacters escaped)."""
    return "(" + "|".join(re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\1", c) for c in choices) + ")"


class Candidate:
    """One engine behind three verbs: compile(kind) -> compiled, matcher(compiled), walk."""

    name = ""

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        """Set the engine up for this tokenizer and the model's vocabulary size."""

    def compile(self, kind: str) -> Any:
        raise NotImplementedError

    def walk(self, compiled: Any, tokens: list[int]) -> float:
        """Seconds spent filling masks and accepting `tokens`, one step per token."""
        raise NotImplementedError


class XGrammar(Candidate):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, kind: str) -> Any:
        if kind == "schema":
            return self.compiler.compile_json_schema(json.dumps(SCHEMA))
        if kind == "regex":
            return self.compiler.compile_regex(REGEX)
        return self.compiler.compile_regex(choice_regex(CHOICES))

    def walk(self, compiled: Any, tokens: list[int]) -> float:
        matcher = self.xgr.GrammarMatcher(compiled)
        t0 = time.perf_counter()
        for t in tokens:
            matcher.fill_next_token_bitmask(self.bitmask)
            if not matcher.accept_token(t):
                raise RuntimeError(f"xgrammar refused token {t}")
        return time.perf_counter() - t0


class LLGuidance(Candidate):
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.lltorch = llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def compile(self, kind: str) -> Any:
        M = self.ll.LLMatcher
        if kind == "schema":
            grammar = M.grammar_from_json_schema(SCHEMA)
        elif kind == "regex":
            grammar = M.grammar_from_regex(REGEX)
        else:
            grammar = M.grammar_from_regex(choice_regex(CHOICES))
        # llguidance compiles lazily: the matcher's construction does the work
        matcher = M(self.tokenizer, grammar)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return grammar

    def walk(self, compiled: Any, tokens: list[int]) -> float:
        matcher = self.ll.LLMatcher(self.tokenizer, compiled)
        t0 = time.perf_counter()
        for t in tokens:
            self.lltorch.fill_next_token_bitmask(matcher, self.bitmask, 0)
            if not matcher.consume_token(t):
                raise RuntimeError(f"llguidance refused token {t}: {matcher.get_error()}")
        return time.perf_counter() - t0


class OutlinesCore(Candidate):
    name = "outlines-core"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import outlines_core

        self.oc = outlines_core
        self.vocab_size = vocab
        self.vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, _byte_vocab(tokenizer))
        self.mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def compile(self, kind: str) -> Any:
        if kind == "schema":
            regex = self.oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
        elif kind == "regex":
            regex = REGEX
        else:
            regex = choice_regex(CHOICES)
        return self.oc.Index(regex, self.vocabulary)

    def walk(self, compiled: Any, tokens: list[int]) -> float:
        guide = self.oc.Guide(compiled)
        t0 = time.perf_counter()
        for t in tokens:
            guide.write_mask_into(self.mask.data_ptr(), self.mask.numel(), 4)
            guide.advance(t)
        return time.perf_counter() - t0


def _byte_vocab(tokenizer: Any) -> dict[bytes, list[int]]:
    """Byte-level BPE tokens as the bytes they stand for (special tokens left out)."""
    decode = {c: b for b, c in _bytes_to_unicode().items()}
    special = set(tokenizer.all_special_ids)
    out: dict[bytes, list[int]] = {}
    for token, i in tokenizer.get_vocab().items():
        if i in special or i == tokenizer.eos_token_id:
            continue
        try:
            raw = bytes(decode[c] for c in token)
        except KeyError:
            continue
        out.setdefault(raw, []).append(i)
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table of byte-level BPE vocabularies."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M)")
    parser.add_argument("--repeat", type=int, default=5, help="walks per case (median kept)")
    args = parser.parse_args(argv)
    from cbgen.models.loader import load_model_config
    from cbgen.models.source import default_model_path, resolve_model
    from cbgen.models.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    source = resolve_model(args.model or default_model_path(), "auto", None, None)
    tokenizer = load_tokenizer(source)
    vocab = load_model_config(source).vocab_size
    print(f"tokenizer {source.name}: {len(tokenizer)} tokens, model vocabulary {vocab}")
    print(
        f"{'engine':14} {'case':12} {'setup s':>8} {'compile ms':>11} {'tokens':>6} {'us/token':>9}"
    )
    candidates: tuple[type[Candidate], ...] = (XGrammar, LLGuidance, OutlinesCore)
    for cls in candidates:
        try:
            setup, engine = timed(functools.partial(cls, tokenizer, vocab))
        except ImportError as e:
            print(f"{cls.name:14} not installed ({e})")
            continue
        for case, (kind, answer) in CASES.items():
            tokens = tokenizer.encode(answer, add_special_tokens=False)
            try:
                compile_s, compiled = timed(functools.partial(engine.compile, kind))
                walks = [engine.walk(compiled, tokens) for _ in range(args.repeat)]
            except Exception as e:  # a candidate's failure is a result to print
                print(f"{cls.name:14} {case:12} failed: {e}")
                continue
            per_token = statistics.median(walks) / len(tokens) * 1e6
            print(
                f"{cls.name:14} {case:12} {setup:8.2f} {compile_s * 1e3:11.1f} "
                f"{len(tokens):6d} {per_token:9.1f}"
            )


if __name__ == "__main__":
    main()
