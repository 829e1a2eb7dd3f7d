"""A request's prompt as token ids: plain text tokenized, a chat through the model's chat template,
the reasoning tags of a thinking model, and bad_words as the token sequences they may appear as
(kept per word list: the n samples of a row ask alike).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cbgen.sampling_params import SamplingParams


class Prompts:
    """The model's tokenizer (None: prompts come as token ids) over a vocabulary of vocab_size."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._bad_words_ids: dict[tuple[str, ...], tuple[tuple[int, ...], ...]] = {}

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: give prompts as token ids")
        return list(self.tokenizer(prompt)["input_ids"])

    def reasoning_tags(self) -> tuple[str, str] | None:
        """('<think>', '</think>') when the tokenizer has both as tokens of their own (a
        thinking model: Qwen3, DeepSeek-R1 and their kind), else None."""
        if self.tokenizer is None:
            return None
        vocab = self.tokenizer.get_vocab()
        tags = ("<think>", "</think>")
        return tags if all(t in vocab for t in tags) else None

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, str]],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The chat's token ids through the model's chat template (or `chat_template`, a Jinja
        text), as transformers renders it; template_kwargs reach the template (for example
        enable_thinking). continue_final_message leaves the last (assistant) message open."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: give prompts as token ids")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "this model has no chat template: give a plain prompt or --chat-template"
            )
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "continue_final_message: cannot be combined with add_generation_prompt "
                "(set add_generation_prompt to false)"
            )
        text = self.tokenizer.apply_chat_template(
            list(messages),
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(template_kwargs or {}),
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def bad_words_token_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """The token sequences params.bad_words may appear as, as vLLM finds them: each word
        (less leading spaces) tokenized as is, and after a space when that gives a different
        first token and as many tokens (the word inside a text)."""
        if not params.bad_words:
            return ()
        words = tuple(params.bad_words)
        hit = self._bad_words_ids.get(words)
        if hit is None:  # validate_request and add_request (and a row's n samples) ask alike
            hit = self._tokenize_bad_words(words)
            if len(self._bad_words_ids) >= 1024:
                self._bad_words_ids.clear()
            self._bad_words_ids[words] = hit
        return hit

    def _tokenize_bad_words(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        if self.tokenizer is None:
            raise ValueError("bad_words: this model has no tokenizer (use logit_bias instead)")
        vocab = self.vocab_size
        found: list[tuple[int, ...]] = []
        for word in words:
            alone, spaced = (
                tuple(self.tokenizer.encode(text, add_special_tokens=False))
                for text in (word.lstrip(), " " + word.lstrip())
            )
            if not alone:
                raise ValueError(f"bad_words: {word!r} has no tokens")
            found.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                found.append(spaced)
        bad = next((t for ids in found for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"bad_words: token id {bad} is outside the vocabulary [0, {vocab})")
        return tuple(found)
