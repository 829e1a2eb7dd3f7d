"""The Python API, familiar to vLLM users: LLM(model).generate(prompts, sampling_params)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, cast

from cbgen.config import EngineConfig
from cbgen.engine.engine import Engine
from cbgen.engine.outputs import RequestOutput
from cbgen.metrics import RequestMetrics
from cbgen.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """LLM(model=None, **engine_options): model None is the default SmolLM2-135M-Instruct;
    engine options are the fields of EngineConfig."""

    def __init__(
        self, model: str | None = None, *, engine: Engine | None = None, **engine_options: Any
    ) -> None:
        self.engine = (
            engine if engine is not None else Engine(EngineConfig(model=model, **engine_options))
        )

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Sequence[Prompt] | Prompt,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One result per prompt and sample, in input order (prompt-major: for n > 1 the n
        samples of a prompt follow each other, with sample_index 0..n-1). A prompt that
        cannot run (empty, too long) gets finish_reason="error" and a message; the others
        run as usual. Sample i of a seeded request uses seed + i."""
        prompt_list: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompt_list = [cast(Prompt, prompts)]
        else:
            prompt_list = list(cast(Sequence[Prompt], prompts))
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(
                    f"sampling_params: {len(params)} given for {len(prompt_list)} prompts"
                )
        engine = self.engine
        results: dict[str, RequestOutput] = {}
        ids = [f"generate-{time.monotonic_ns()}-{i}" for i in range(len(prompt_list))]
        order: list[str] = []
        for rid, prompt, p in zip(ids, prompt_list, params, strict=True):
            for i in range(p.n):
                sid = f"{rid}-{i}"
                order.append(sid)
                try:
                    sample = p.replace(n=1, seed=None if p.seed is None else p.seed + i)
                    engine.add_request(sid, prompt, sample)
                except ValueError as e:
                    tokens = prompt if isinstance(prompt, list) else []
                    results[sid] = error_output(sid, tokens, str(e))
        while engine.has_unfinished_requests():
            for out in engine.step().finished:
                results[out.request_id] = out
        return [
            dataclasses.replace(results[sid], sample_index=int(sid.rsplit("-", 1)[1]))
            for sid in order
        ]


def error_output(request_id: str, prompt_token_ids: Sequence[int], message: str) -> RequestOutput:
    now = time.perf_counter()
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        output_token_ids=[],
        text="",
        finish_reason="error",
        error=message,
        num_preemptions=0,
        num_cached_tokens=0,
        stop_reason=None,
        metrics=RequestMetrics.from_times(now, None, [], None),
    )
