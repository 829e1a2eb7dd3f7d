"""Engine: add_request, step, and the start-up that puts its parts together (device, model,
KV blocks, scheduler, runner, EOS; the steps of it in cbgen.engine.startup).

step():  schedule -> runner.execute -> scheduler.update_from_output -> stop strings
         -> StepOutput(finished requests, stats)

Prompts become token ids in cbgen.engine.prompts; finished requests become text and
RequestOutputs in cbgen.engine.detokenize.

Longer than 400 lines: the Engine is the one object its callers hold, and its start-up reads in
order in __init__ (each step's work in startup.py), next to the request and step paths that use
what it set up; its start-up line is composed in describe.py, a request's checks in
admission.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any, cast

import torch

from cbgen.attention import get_attention_backend
from cbgen.config import EngineConfig
from cbgen.engine.admission import check_request
from cbgen.engine.cuda_graphs import capture_sizes, graphs_unavailable
from cbgen.engine.describe import describe_engine
from cbgen.engine.detokenize import Detokenizer
from cbgen.engine.memory import check_quantized_memory, plan_cpu_weights
from cbgen.engine.outputs import RequestOutput, StepOutput, StepStats
from cbgen.engine.prompts import Prompts
from cbgen.engine.request import Request, RequestStatus
from cbgen.engine.runner import ModelRunner, NewRequestInfo, RunnerOutput
from cbgen.engine.scheduler import Scheduler, SchedulerOutput
from cbgen.engine.startup import (
    check_cuda_memory,
    kv_bytes_per_block,
    make_kv_cache,
    make_scheduler,
    num_kv_blocks,
    profile_cuda_kv_budget,
    resolve_device,
    resolve_dtype,
    resolve_kv_dtype,
)
from cbgen.engine.static_scheduler import PaddingStats, StaticScheduler
from cbgen.engine.structured import Grammars, GrammarState, reasoning_open
from cbgen.models.base import CausalLM
from cbgen.models.gguf_model import gguf_resident_bytes
from cbgen.models.loader import load_model, load_model_config, stored_weight_dtype
from cbgen.models.source import resolve_model
from cbgen.models.tokenizer import load_tokenizer
from cbgen.phases import LOAD, phase
from cbgen.runtime import Runtime, bind, cpu_bf16_mode, quantized_types
from cbgen.sampling_params import SamplingParams

logger = logging.getLogger("cbgen")


class Engine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        share_weights_with: Engine | None = None,
        **options: Any,
    ) -> None:
        """share_weights_with: reuse another engine's model and tokenizer (same model, device
        and dtype), e.g. to compare scheduling settings without loading twice."""
        config = (
            (config or EngineConfig()).replace(**options) if options else (config or EngineConfig())
        )
        self.config = config
        t0 = time.perf_counter()
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.source = resolve_model(
            config.model, config.load_format, config.revision, config.download_dir
        )
        self.model_config = load_model_config(self.source)
        mc = self.model_config
        self.cpu_bf16: str | None = None
        """On the CPU, how bfloat16 runs ("dot" or "widen": cbgen.runtime.cpu_bf16_mode): bf16
        weights under float32 activations, so self.dtype is float32 then."""
        if self.device.type == "cpu":
            stored = stored_weight_dtype(self.source, config.load_format)
            self.cpu_bf16 = cpu_bf16_mode(
                config.dtype, config.attention_backend, config.cpu_weight_dtype, stored
            )
            if self.cpu_bf16 is not None:
                self.dtype = torch.float32
        limit = mc.max_position_embeddings
        self.max_model_len = config.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len: {self.max_model_len} exceeds the model's limit of {limit}"
            )
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            # Without chunking a prompt must fit in one step's budget.
            self.max_prompt_len = config.max_num_batched_tokens
        else:
            self.max_prompt_len = self.max_model_len
        self.backend = get_attention_backend(
            config.attention_backend,
            self.device,
            self.dtype,
            config.block_size,
            sliding_window=mc.sliding_window is not None,
            logit_softcap=mc.attn_logit_softcap is not None,
        )
        self.kv_dtype = resolve_kv_dtype(
            config.kv_cache_dtype, self.dtype, self.cpu_bf16, self.backend.name
        )
        """The KV cache's dtype (resolve_kv_dtype)."""
        # bf16 dot products in the prompts' attention too, over a bf16 cache's rows
        self.backend.bf16_dot_products = self.cpu_bf16 == "dot" and self.kv_dtype == torch.bfloat16
        self.tokenizer: Any
        self.model: CausalLM
        self.runtime: Runtime
        """The model bound to its device (cbgen.runtime): its kernels, forward, exact head."""
        self.weight_dtype = self.dtype
        """The weights' storage: the dtype, or on the CPU in float32 a half dtype that each
        matmul upcasts (cbgen.engine.memory.plan_cpu_weights)."""
        if share_weights_with is not None:
            other = share_weights_with
            if (other.source, other.dtype, other.device) != (self.source, self.dtype, self.device):
                raise ValueError(
                    "share_weights_with: the other engine has another model, dtype or device"
                )
            if other.max_model_len < self.max_model_len:
                raise ValueError("share_weights_with: the other engine has a shorter max_model_len")
            if other.cpu_bf16 != self.cpu_bf16:
                raise ValueError("share_weights_with: the other engine runs bfloat16 otherwise")
            if other.keep_quantized() != self.keep_quantized():
                raise ValueError("share_weights_with: the other engine dequantizes otherwise")
            self.tokenizer, self.model = other.tokenizer, other.model
            self.weight_dtype = other.weight_dtype
            self.runtime = other.runtime
            self.runtime.use_threads(config.num_threads)
        else:
            if self.device.type == "cpu" and self.keep_quantized():
                need = gguf_resident_bytes(self.source.path, self.keep_quantized())
                check_quantized_memory(need, self.source.name)
            elif self.device.type == "cpu":
                kept = "bfloat16" if self.cpu_bf16 is not None else config.cpu_weight_dtype
                self.weight_dtype = plan_cpu_weights(mc, self.dtype, kept, stored, self.source.name)
            with phase(LOAD, f"loading model {self.source.name}"):
                self.tokenizer = load_tokenizer(self.source)
                self.model = load_model(
                    self.source,
                    mc,
                    self.dtype,
                    self.device,
                    self.max_model_len,
                    config.load_format,
                    config.seed,
                    self.weight_dtype,
                    keep_quantized=self.keep_quantized(),
                )
            with phase(LOAD, f"preparing the model for {self.device.type}"):  # tuning inside
                self.runtime = bind(
                    self.model, self.device, self.dtype, config.num_threads, self.cpu_bf16 == "dot"
                )
        self.prompts = Prompts(self.tokenizer, mc.vocab_size)
        """Prompts and chats to token ids; bad_words to theirs."""
        self.detokenizer = Detokenizer(self.tokenizer)
        """Finished requests to text and RequestOutputs."""
        self._grammars: Grammars | None = None  # built when a request first has a constraint
        self.load_time_s = time.perf_counter() - t0
        self.memory_plan: dict[str, int] = {}
        """On CUDA without kv_cache_memory: the profile's peak, the graphs' reserve, the budget
        and, after start-up, what torch and everything else hold (bytes)."""
        self.num_blocks = num_kv_blocks(
            config,
            self.device,
            self.kv_bytes_per_block,
            lambda: profile_cuda_kv_budget(
                self.model,
                self.backend,
                config,
                self.max_model_len,
                self.dtype,
                self.device,
                self.memory_plan,
            ),
        )
        self.kv = make_kv_cache(config, mc, self.num_blocks)
        self.scheduler: Scheduler = make_scheduler(config, self.kv, self.max_model_len)
        self.runner = ModelRunner(
            self.model,
            self.backend,
            self.num_blocks,
            config.block_size,
            config.max_num_seqs,
            self.max_model_len,
            self.device,
            self.kv_dtype,
            config.max_num_batched_tokens,
            runtime=self.runtime,
        )
        self.graphs_off = graphs_unavailable(self.device, self.backend.name, config.enforce_eager)
        """Why decode steps run eagerly (None: they replay CUDA graphs)."""
        if self.graphs_off is None:
            try:
                graphs = self.runner.capture_graphs(capture_sizes(config.max_num_seqs))
            except RuntimeError as e:  # an op that cannot be captured: run eagerly, say why
                self.graphs_off = f"capture failed: {str(e).splitlines()[0]}"
                logger.warning("CUDA graphs: %s; decode steps run eagerly", self.graphs_off)
            else:
                logger.info(
                    "captured %d CUDA graphs for decode steps in %.1f s",
                    len(graphs),
                    graphs.capture_time_s,
                )
        if self.device.type == "cuda" and config.kv_cache_memory is None:
            check_cuda_memory(config, self.device, self.memory_plan)
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if eos is None and mc.eos_token_ids:
            eos = mc.eos_token_ids[0]
        self.eos_token_id: int | None = eos
        self._request_counter = 0
        self.total_preemptions = 0
        self.init_time_s = time.perf_counter() - t0

    # ---- start-up --------------------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model_config, self.config.block_size, self.kv_dtype)

    def describe(self) -> str:
        """The start-up line: model, device and dtype, attention, KV cache, the runtime's kernels."""
        return describe_engine(self)

    def keep_quantized(self) -> frozenset[int]:
        """The ggml types a GGUF file's linear tensors, embedding and LM head stay in (run in
        their blocks by the runtime): none with --dequantize, on other devices, under
        --dtype bfloat16 (the file dequantized into bf16), or where torch's own bf16/fp16 runs
        the model."""
        if (
            self.source.kind != "gguf"
            or self.config.dequantize
            or self.dtype != torch.float32
            or self.cpu_bf16 is not None
        ):
            return frozenset()
        return quantized_types(self.device)

    @property
    def dtype_name(self) -> str:
        """What the run computes in, as the user names it: bfloat16 for the CPU's bf16 modes
        (whose activations are float32), else self.dtype."""
        return "bfloat16" if self.cpu_bf16 is not None else str(self.dtype).removeprefix("torch.")

    # ---- requests --------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.prompts.tokenize(prompt)

    def reasoning_tags(self) -> tuple[str, str] | None:
        """('<think>', '</think>') on a thinking model, else None (Prompts.reasoning_tags)."""
        return self.prompts.reasoning_tags()

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, str]],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The chat's token ids through the model's chat template (Prompts.apply_chat_template)."""
        return self.prompts.apply_chat_template(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
        )

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Queue one request. Raises ValueError (and changes nothing) if it can never run."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            token_ids = self.tokenize(prompt)
        elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
            token_ids = list(cast(Sequence[int], prompt))
        else:
            raise ValueError(
                f"prompt: must be text or a list of token ids, got {type(prompt).__name__}"
            )
        self.validate_request(token_ids, params)
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        seed = (
            params.seed
            if params.seed is not None
            else self.config.seed * 1_000_003 + self._request_counter
        )
        self._request_counter += 1
        req = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
            eos_token_id=self.eos_token_id,
        )
        # Held back while fewer than min_tokens exist; EOS only when it would stop generation.
        stop_ids = tuple(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            stop_ids += (self.eos_token_id,)
        info = NewRequestInfo(
            len(token_ids),
            params,
            seed,
            stop_ids,
            self.bad_words_token_ids(params),
            self._grammar_state(token_ids, params),
        )
        self.runner.add_request(request_id, info)
        self.scheduler.add_request(req)
        return req

    def validate_request(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        """ValueError naming the field if the request can never run here (check_request)."""
        check_request(self, token_ids, params)

    def bad_words_token_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """The token sequences params.bad_words may appear as (Prompts.bad_words_token_ids)."""
        return self.prompts.bad_words_token_ids(params)

    @property
    def grammars(self) -> Grammars:
        """The structured-outputs compiler and its cache (built on first use)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs: this model has no tokenizer")
            stop = [] if self.eos_token_id is None else [self.eos_token_id]
            self._grammars = Grammars(self.tokenizer, self.model_config.vocab_size, stop)
        return self._grammars

    def _grammar_state(
        self, token_ids: Sequence[int], params: SamplingParams
    ) -> GrammarState | None:
        """A new sequence's matcher; on a thinking model it waits for the reasoning end tag
        unless the prompt closed the block already."""
        if params.structured_outputs is None:
            return None
        waiting_for = None
        tags = self.reasoning_tags()
        if tags is not None:
            start, end = self.tokenizer.convert_tokens_to_ids(list(tags))
            waiting_for = end if reasoning_open(token_ids, start, end) else None
        return self.grammars.state(params.structured_outputs, waiting_for)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    @property
    def num_slots(self) -> int:
        """The most requests that compute at once: max_num_seqs, or under the static policy
        its batch size (when smaller)."""
        if self.config.scheduling_policy == "static":
            return min(self.config.static_batch_size, self.config.max_num_seqs)
        return self.config.max_num_seqs

    @property
    def padding_stats(self) -> PaddingStats | None:
        """What the static policy has computed so far, padding apart (a copy); None under the
        continuous policy, which pads nothing."""
        if isinstance(self.scheduler, StaticScheduler):
            return dataclasses.replace(self.scheduler.padding)
        return None

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix, so that the next requests start cold (a timed run
        after a warm-up). Blocks held by requests in flight stay theirs, no longer shared."""
        self.kv.pool.reset_prefix_cache()

    def abort(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        reqs = [self.scheduler.requests[r] for r in request_ids if r in self.scheduler.requests]
        self.scheduler.finish(reqs, time.perf_counter(), RequestStatus.FINISHED_ABORTED)
        return [self.detokenizer.output(r) for r in reqs]

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> StepOutput:
        t0 = time.perf_counter()
        out = self.scheduler.schedule(t0)
        result = self.runner.execute(out)
        sampled = result.sampled
        now = time.perf_counter()
        self._record_logprobs(result)
        finished = self.scheduler.update_from_output(out, sampled, now)
        finished += self._check_stop_strings(sampled, finished, now)
        if result.grammar_done:
            finished += self._finish_grammars(result.grammar_done, now)
        self.total_preemptions += len(out.preempted_ids)
        return StepOutput(
            finished=[self.detokenizer.output(r) for r in finished],
            stats=self._stats(out, t0, now),
        )

    def _record_logprobs(self, result: RunnerOutput) -> None:
        """Hand the step's logprobs to their requests (all still running: before
        update_from_output, which may finish them)."""
        requests = self.scheduler.requests
        for rid, scored in result.prompt_logprobs.items():
            requests[rid].prompt_logprobs += scored
        for rid, lp in result.logprobs.items():
            requests[rid].logprobs.append(lp)

    def _finish_grammars(self, request_ids: Sequence[str], now: float) -> list[Request]:
        """Stop the requests whose grammar is complete (or refused the token sampled), those
        that no stop rule finished already in this step."""
        requests = self.scheduler.requests
        done = [requests[r] for r in request_ids if r in requests]
        if done:
            self.scheduler.finish(done, now, RequestStatus.FINISHED_STOPPED)
        return done

    def _check_stop_strings(
        self, sampled: dict[str, int], finished: list[Request], now: float
    ) -> list[Request]:
        """Finish requests whose newest token completed a stop string (once min_tokens exist).
        A request that reached max_tokens on that same token is marked stopped too."""
        just_finished = {r.request_id: r for r in finished}
        hits = []
        for rid in sampled:
            req = self.scheduler.requests.get(rid) or just_finished.get(rid)
            if (
                req is None
                or not req.sampling_params.stop
                or req.status == RequestStatus.FINISHED_STOPPED
            ):
                continue
            if req.num_output_tokens < req.sampling_params.min_tokens:
                continue
            stop = self.detokenizer.find_stop_string(req)
            if stop is None:
                continue
            req.stop_reason = stop
            if not req.is_finished:
                hits.append(req)
            req.status = RequestStatus.FINISHED_STOPPED
        if hits:
            self.scheduler.finish(hits, now)
        return hits

    def _stats(self, out: SchedulerOutput, t0: float, now: float) -> StepStats:
        return StepStats(
            time=now,
            duration_s=now - t0,
            num_scheduled=len(out.scheduled),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks_used=self.kv.num_used_blocks,
            num_kv_blocks_total=self.num_blocks,
            num_preempted=len(out.preempted_ids),
            total_preemptions=self.total_preemptions,
            num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=out.num_decode_tokens,
            num_cached_tokens=out.num_cached_tokens,
        )
