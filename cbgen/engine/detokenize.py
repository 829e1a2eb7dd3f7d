"""A finished request back to text: its tokens decoded (the stop token left out, the text cut
before a stop string), each logprob token's own text (memoised), and the RequestOutput the
engine hands on. Also the tail decode that finds a stop string as tokens arrive.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from cbgen.engine.logprobs import TokenLogprob, with_text
from cbgen.engine.outputs import RequestOutput
from cbgen.engine.request import Request, RequestStatus
from cbgen.metrics import RequestMetrics


class Detokenizer:
    """Text from token ids through the model's tokenizer (None: no tokenizer, empty texts)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str | None] = {}

    def decode(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def find_stop_string(self, req: Request) -> str | None:
        """The stop string that the newest tokens complete, if any. Only the tail is decoded:
        a stop string of L characters spans at most L tokens (plus a few partial bytes)."""
        stops = req.sampling_params.stop
        window = max(len(s) for s in stops) + 8
        text = self.decode(req.output_token_ids[-window:])
        found = [(text.find(s), s) for s in stops if s in text]
        return min(found)[1] if found else None

    def token_text(self, token_id: int) -> str | None:
        """One token's text alone, special tokens included (vLLM's logprob token); memoised."""
        text = self._token_texts.get(token_id)
        if text is None and self.tokenizer is not None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprobs_of(self, req: Request) -> dict[str, Any]:
        """RequestOutput's logprob fields: None where the request did not ask."""
        params = req.sampling_params
        fields: dict[str, Any] = {}
        if params.logprobs is not None:
            fields["logprobs"] = with_text(req.logprobs, self.token_text)
            fields["cumulative_logprob"] = math.fsum(p.logprob for p in req.logprobs)
        if params.prompt_logprobs is not None:
            scored: list[TokenLogprob | None] = [None]
            fields["prompt_logprobs"] = scored + with_text(req.prompt_logprobs, self.token_text)
        return fields

    def output(self, req: Request) -> RequestOutput:
        """The request as it stands (finished, or aborted), with its text and timings."""
        tokens = req.output_token_ids
        if req.status == RequestStatus.FINISHED_STOPPED and not isinstance(req.stop_reason, str):
            tokens = tokens[:-1]  # the stop token (EOS or a stop id) is not part of the text
        text = self.decode(tokens)
        if isinstance(req.stop_reason, str) and req.stop_reason in text:
            text = text[: text.index(req.stop_reason)]
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=list(req.output_token_ids),
            text=text,
            finish_reason=req.status.finish_reason or "abort",
            error=None,
            num_preemptions=req.num_preemptions,
            num_cached_tokens=req.num_cached_tokens,
            stop_reason=req.stop_reason,
            metrics=RequestMetrics.from_times(
                req.arrival_time, req.first_scheduled_time, req.token_times, req.finished_time
            ),
            **self._logprobs_of(req),
        )
