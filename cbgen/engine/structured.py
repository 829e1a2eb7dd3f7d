"""Structured outputs: a row's constraint (JSON schema, regex, choice, grammar) as a token mask,
through xgrammar (chosen by measurement: docs/DESIGN.md).

    Engine.validate_request  Grammars.compile(spec)      once per distinct spec (cached by its
                                                          text); ValueError when it cannot compile
    Engine.add_request       Grammars.state(spec, ...)   one GrammarState (matcher) per sequence
    Sampler                  apply_grammar_masks(...)     fill and apply the bitmask of the rows
                                                          that have one, before sampling
    ModelRunner              GrammarState.accept(token)   after each sampled token

A state lives as long as its request, preemption included: a recompute re-derives K/V for
tokens the matcher has already accepted and samples only the next one, so the matcher is
exactly where it was. Rows without a constraint never reach this module.

For a thinking model the constraint starts after the reasoning block: the state waits for the
end tag's token (</think>) in the output, unless the prompt already closed the block.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cbgen.sampling_params import StructuredOutputs

ANY_OBJECT = '{"type": "object", "additionalProperties": true}'
"""json_object's schema: any JSON object."""
CACHE_LIMIT = 256
"""Compiled grammars kept (the least recently used is dropped first)."""


def choice_regex(choices: Sequence[str]) -> str:
    """An alternation matching exactly one of the strings (regex metacharacters escaped)."""
    return "(" + "|".join(re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\1", c) for c in choices) + ")"


@dataclass(frozen=True)
class _Failed:
    """A spec that did not compile, and why."""

    message: str


class GrammarState:
    """One sequence's place in its grammar. While `waiting_for` is a token id (a thinking
    model's reasoning end tag), tokens pass unconstrained and unfed; from that token on every
    token is fed to the matcher."""

    def __init__(self, grammars: Grammars, matcher: Any, waiting_for: int | None = None) -> None:
        self.grammars = grammars
        self.matcher = matcher
        self.waiting_for = waiting_for
        self.failed = False
        """The matcher refused a token (a stop id held back by min_tokens, for one)."""

    @property
    def active(self) -> bool:
        """Whether the next token is constrained."""
        return self.waiting_for is None and not self.failed

    @property
    def finished(self) -> bool:
        """The grammar is complete and its stop token accepted, or it can go no further."""
        return self.failed or bool(self.matcher.is_terminated())

    def accept(self, token: int) -> None:
        if self.waiting_for is not None:
            if token == self.waiting_for:
                self.waiting_for = None
            return
        if not self.failed and not self.matcher.accept_token(token):
            self.failed = True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class Grammars:
    """The compiler for one tokenizer, its compiled grammars by spec, and a bitmask buffer."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr  # on first use: an engine without constraints never imports it

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.compiled: dict[tuple[str, str], Any] = {}
        self.num_compiled = 0
        """Grammars compiled so far (cache misses)."""
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled grammar of spec, compiled on first sight; ValueError naming the field
        when the engine cannot compile it."""
        key = spec.key
        hit = self.compiled.pop(key, None)
        if hit is None:
            try:
                hit = self._compile(spec)
            except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                hit = _Failed(f"structured_outputs: the {spec.kind} does not compile: {first}")
            self.num_compiled += 1
            if len(self.compiled) >= CACHE_LIMIT:
                del self.compiled[next(iter(self.compiled))]
        self.compiled[key] = hit  # most recent last; a failure is remembered too
        if isinstance(hit, _Failed):
            raise ValueError(hit.message)
        return hit

    def _compile(self, spec: StructuredOutputs) -> Any:
        c = self.compiler
        # JSON without free whitespace: small models otherwise wander into endless blank lines
        if spec.json_object:
            return c.compile_json_schema(ANY_OBJECT, any_whitespace=False)
        if spec.json is not None:
            return c.compile_json_schema(spec.key[1], any_whitespace=False)
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            return c.compile_regex(choice_regex(spec.choice))
        assert spec.grammar is not None  # StructuredOutputs holds exactly one kind
        if "::=" in spec.grammar:
            return c.compile_grammar(spec.grammar)
        return c.compile_lark(spec.grammar)

    def state(self, spec: StructuredOutputs, waiting_for: int | None = None) -> GrammarState:
        """A new sequence's state (spec compiled already, or now)."""
        return GrammarState(self, self._xgr.GrammarMatcher(self.compile(spec)), waiting_for)

    def apply(
        self, logits: torch.Tensor, rows: Sequence[int], states: Sequence[GrammarState]
    ) -> None:
        """Mask (to -inf) in logits [B, V] every token that states[j] forbids in row rows[j]."""
        if self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = self._xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        bitmask = self._bitmask[: logits.shape[0]]
        for row, state in zip(rows, states, strict=True):
            state.fill(bitmask, row)
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        self._xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self.vocab_size, indices=list(rows)
        )


def apply_grammar_masks(
    logits: torch.Tensor, rows: Sequence[int], states: Sequence[GrammarState]
) -> None:
    """Mask logits [B, V] in place: row rows[j] to the tokens states[j] allows next."""
    states[0].grammars.apply(logits, rows, states)


def reasoning_open(prompt_token_ids: Sequence[int], start: int, end: int) -> bool:
    """Whether generation starts outside a closed reasoning block: the prompt's last reasoning
    tag is not the end tag (no tag at all: the model opens the block itself)."""
    for t in reversed(prompt_token_ids):
        if t == end:
            return False
        if t == start:
            return True
    return True
