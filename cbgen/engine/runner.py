"""ModelRunner: turns a SchedulerOutput into the flat batch, runs the model, samples.

The flat batch (no padding), for B scheduled requests and T tokens:

    input_ids[T], positions[T], slot_mapping[T]
    query_start_loc[B + 1]      request i owns tokens [qsl[i], qsl[i + 1])
    seq_lens[B]                 context + new tokens of request i
    block_table[B, max_blocks_per_seq]  each request's blocks, every column of a
                                max_model_len sequence (fixed width)

Block tables live in one preallocated [max_num_seqs, max_blocks_per_seq] array: a request
keeps its row while it runs and only its new block ids are written each step. The step's
tensors are written into preallocated staging buffers and reach the device in one copy
(step_inputs); decode-only steps may be padded to a bucket size and replayed from a CUDA
graph (cuda_graphs).

Logits are computed at the last position of each request that samples, and, for requests
with prompt_logprobs, at the prompt positions this step computes (prompt_scoring).

Longer than 400 lines: one object owns the per-row state (block table rows, staged sampling
parameters, generators, device-draw counts) that the bookkeeping, the flat batch, graph padding
and sampling all read and advance within a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from cbgen.attention import AttentionBackend, AttentionMetadata
from cbgen.engine.cuda_graphs import DecodeGraphs, bucket_for
from cbgen.engine.logprobs import PositionLogprobs
from cbgen.engine.memory import mapped_zeros
from cbgen.engine.prompt_scoring import PromptScorer
from cbgen.engine.sampler import (
    Sampler,
    SamplingRow,
    SamplingTensors,
    position_logprobs,
    seed_int64,
)
from cbgen.engine.scheduler import SchedulerOutput
from cbgen.engine.step_inputs import StepBuffers, fill_padding
from cbgen.engine.structured import GrammarState
from cbgen.models.base import CausalLM
from cbgen.runtime.base import Runtime
from cbgen.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestInfo:
    """What the runner needs once per request, registered by the engine at add_request."""

    prompt_len: int
    params: SamplingParams
    seed: int
    stop_ids_for_min_tokens: tuple[int, ...]
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    """params.bad_words as token sequences (the engine has the tokenizer)."""
    grammar: GrammarState | None = None
    """params.structured_outputs' matcher: kept through preemption (see engine/structured)."""


@dataclass(frozen=True)
class RunnerOutput:
    """What one step produced."""

    sampled: dict[str, int] = field(default_factory=dict)
    """The sampled token of every request that caught up."""
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    """Of those, the requests with logprobs: their sampled token's."""
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    """Requests with prompt_logprobs: the prompt tokens scored this step, in order."""
    grammar_done: tuple[str, ...] = ()
    """Requests whose grammar ended with this step's token (or refused it)."""


SAMPLING_FIELDS = (
    ("temperature", np.float32),
    ("top_k", np.int64),
    ("top_p", np.float32),
    ("min_p", np.float32),
)
"""The SamplingParams fields the runner stages per row (sampler.SamplingTensors, in order)."""


@dataclass
class _RowState:
    row: int
    token_ids: list[int]
    num_blocks: int


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        max_num_batched_tokens: int | None = None,
        device_draws: bool | None = None,
        runtime: Runtime | None = None,
    ) -> None:
        """max_num_batched_tokens: the most tokens a step holds (None: max_model_len).
        device_draws: sampled rows draw their uniform numbers on the device from (seed, draw
        count) rather than from host generators (None: on CUDA; see Sampler). runtime: the
        model bound to its device (cbgen.runtime.bind; None: the model as it is)."""
        cfg = model.config
        self.model = model
        self.runtime = Runtime(model) if runtime is None else runtime
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.kv_caches = [
            mapped_zeros(
                (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim), dtype, device
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.block_table = np.zeros((max_num_seqs, self.max_blocks_per_seq), dtype=np.int32)
        self.row_sampling = {
            name: np.zeros(max_num_seqs, dtype=dtype) for name, dtype in SAMPLING_FIELDS
        }
        """Per row, like block_table: the sampling parameters of the request holding it."""
        self.row_random = np.zeros(max_num_seqs, dtype=bool)
        """Per row: whether its request samples at random (not greedy)."""
        self.device_draws = device.type == "cuda" if device_draws is None else device_draws
        self.row_seed = np.zeros(max_num_seqs, dtype=np.int64)
        self.row_draws = np.zeros(max_num_seqs, dtype=np.int64)
        """Per row, device draws: its request's seed and draw count."""
        self.row_prompt_len = np.zeros(max_num_seqs, dtype=np.int64)
        """Each row's prompt length (AttentionMetadata.prompts: a row's new tokens from below it
        are a prompt's)."""
        self.max_model_len = max_model_len
        self.buffers = StepBuffers(
            max_num_seqs,
            max(max_num_batched_tokens or max_model_len, max_num_seqs),
            self.max_blocks_per_seq,
            device,
        )
        self.decode_sizes: tuple[int, ...] = ()
        """Bucket sizes decode-only steps are padded to (none: no padding)."""
        self.graphs: DecodeGraphs | None = None
        """Their captured forward passes (CUDA only; None: padded steps run eagerly)."""
        self.staged_sampling: SamplingTensors | None = None
        """The step's sampling rows' parameters, staged by prepare_inputs (None: all greedy)."""
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.rows: dict[str, _RowState] = {}
        self.infos: dict[str, NewRequestInfo] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.draws: dict[str, int] = {}
        """Device draws: numbers each sampled request has drawn so far. Kept through
        preemption, so a recompute continues its stream as a host generator would."""
        self.prompt_scorer = PromptScorer()
        self.sampler = Sampler(self.device_draws, self.runtime.plain_sample)

    # ---- request bookkeeping -----------------------------------------------------------
    def add_request(self, request_id: str, info: NewRequestInfo) -> None:
        self.infos[request_id] = info
        if not info.params.greedy and self.device_draws:
            self.draws[request_id] = 0
        elif not info.params.greedy:
            # On the host whatever the device: the draws (the sampler's uniform number, the bf16
            # head's seed) are made there, one per row, so a seeded request draws the same
            # numbers alone or in any batch. A CUDA generator would refuse a host draw.
            self.generators[request_id] = torch.Generator(device="cpu").manual_seed(info.seed)
        if info.params.prompt_logprobs is not None:
            self.prompt_scorer.add(request_id)

    def _drop_row(self, request_id: str) -> None:
        state = self.rows.pop(request_id, None)
        if state is not None:
            self.free_rows.append(state.row)

    def _forget(self, request_id: str) -> None:
        self._drop_row(request_id)
        self.infos.pop(request_id, None)
        self.generators.pop(request_id, None)
        self.draws.pop(request_id, None)
        self.prompt_scorer.forget(request_id)

    # ---- one step -------------------------------------------------------------------------
    def _update_states(self, out: SchedulerOutput) -> None:
        for rid in out.finished_ids:
            self._forget(rid)
        for rid in out.preempted_ids:
            self._drop_row(rid)  # recomputed on readmission; its generator lives on
        for s in out.scheduled:
            if s.new_token_ids is not None:
                self._drop_row(s.request_id)
                state = _RowState(self.free_rows.pop(), list(s.new_token_ids), 0)
                self.rows[s.request_id] = state
                # the static policy's padding members have no info: they never sample
                info = self.infos.get(s.request_id)
                if info is not None:
                    for name, _ in SAMPLING_FIELDS:
                        self.row_sampling[name][state.row] = getattr(info.params, name)
                self.row_random[state.row] = info is not None and not info.params.greedy
                self.row_seed[state.row] = 0 if info is None else seed_int64(info.seed)
                self.row_draws[state.row] = self.draws.get(s.request_id, 0)
                # a padding member's tokens are all prompt
                self.row_prompt_len[state.row] = (
                    len(state.token_ids) if info is None else info.prompt_len
                )
            else:
                state = self.rows[s.request_id]
            n = len(s.new_block_ids)
            if n:
                self.block_table[state.row, state.num_blocks : state.num_blocks + n] = (
                    s.new_block_ids
                )
                state.num_blocks += n

    def prepare_inputs(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The flat batch for this step: (input_ids, positions, metadata, logits_indices),
        written into the staging buffers and moved to the device in one copy (views of the
        runner's static device buffers, valid until the next step). A decode-only step is
        padded to its bucket when decode_sizes are set (step_inputs.fill_padding)."""
        bs = self.block_size
        buffers = self.buffers
        host = buffers.host
        sched = out.scheduled
        num_seqs = len(sched)
        states = [self.rows[s.request_id] for s in sched]
        rows = np.fromiter((st.row for st in states), dtype=np.int64, count=num_seqs)
        num_new = np.fromiter((s.num_new_tokens for s in sched), dtype=np.int64, count=num_seqs)
        computed = np.fromiter(
            (s.num_computed_tokens for s in sched), dtype=np.int64, count=num_seqs
        )
        ends = np.cumsum(num_new)
        total = int(ends[-1])
        if total > buffers.max_num_tokens:
            raise ValueError(
                f"max_num_batched_tokens: a step of {total} tokens exceeds the runner's "
                f"{buffers.max_num_tokens}"
            )
        buffers.begin()
        qsl = host["query_start_loc"][: num_seqs + 1]
        qsl[0] = 0
        qsl[1:] = ends
        starts = ends - num_new
        seq_lens = computed + num_new
        host["seq_lens"][:num_seqs] = seq_lens
        # positions: for token t of request i, computed[i] + (t - qsl[i])
        positions = host["positions"][:total]
        positions[:] = np.repeat(computed - starts, num_new) + np.arange(total)
        token_rows = np.repeat(rows, num_new)
        host["slot_mapping"][:total] = (
            self.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        )
        input_ids = host["input_ids"]
        if total == num_seqs:  # one token each (decodes, or 1-token prompt chunks)
            input_ids[:total] = np.fromiter(
                (st.token_ids[s.num_computed_tokens] for s, st in zip(sched, states, strict=True)),
                dtype=np.int64,
                count=total,
            )
        else:
            for s, st, start in zip(sched, states, starts.tolist(), strict=True):
                c, n = s.num_computed_tokens, s.num_new_tokens
                input_ids[start : start + n] = st.token_ids[c : c + n]
        np.take(self.block_table, rows, axis=0, out=host["block_table"][:num_seqs])
        sample_mask = np.fromiter((s.will_sample for s in sched), dtype=bool, count=num_seqs)
        logits_indices = ends[sample_mask] - 1
        host["logits_indices"][: len(logits_indices)] = logits_indices
        self.staged_sampling = self._stage_sampling(rows[sample_mask])
        num_rows = self._decode_bucket(out) or num_seqs
        if num_rows > num_seqs:
            fill_padding(host, num_seqs, num_rows)
        buffers.upload(num_rows)
        ids, pos, meta, logits_rows = buffers.views(
            total if num_rows == num_seqs else num_rows,
            num_rows,
            len(logits_indices),
            int(num_new.max()),
            int(seq_lens.max()),
            bs,
        )
        if num_rows == num_seqs:
            meta.prompts = computed < self.row_prompt_len[rows]
        return ids, pos, meta, logits_rows

    def _stage_sampling(self, rows: np.ndarray) -> SamplingTensors | None:
        """The temperature, top-k, top-p and min-p of the sampling requests in these rows, in
        the staging buffers so they travel with the step's one copy (None when all are
        greedy: the sampler needs none)."""
        if not self.row_random[rows].any():
            return None
        n = len(rows)
        host = self.buffers.host
        for name, _ in SAMPLING_FIELDS:
            self.row_sampling[name].take(rows, out=host[name][:n])
        if not self.device_draws:
            return SamplingTensors(*self.buffers.sampling_views(n))
        self.row_seed.take(rows, out=host["seed"][:n])
        self.row_draws.take(rows, out=host["draws"][:n])
        return SamplingTensors(*self.buffers.sampling_views(n), *self.buffers.draw_views(n))

    def pad_decodes(self, sizes: tuple[int, ...]) -> None:
        """Pad every decode-only step to the smallest of sizes that holds it (eagerly unless
        graphs are captured for them); () turns padding off."""
        self.decode_sizes = tuple(sorted(sizes))

    @torch.inference_mode()
    def capture_graphs(self, sizes: tuple[int, ...]) -> DecodeGraphs:
        """Capture a CUDA graph of a decode-only step's forward pass per size; from now on
        decode-only steps are padded to the smallest size that holds them and replayed."""
        graphs = DecodeGraphs(sizes)
        graphs.capture(self._stage_padding, self._padded_forward)
        self.pad_decodes(graphs.sizes)
        self.graphs = graphs
        return graphs

    def _stage_padding(self, num_rows: int) -> None:
        """Fill the static buffers with num_rows padding rows (what a capture runs on)."""
        self.buffers.begin()
        self.buffers.host["query_start_loc"][0] = 0
        fill_padding(self.buffers.host, 0, num_rows)
        self.buffers.upload(num_rows)

    def _padded_forward(self, num_rows: int) -> tuple[torch.Tensor, AttentionMetadata]:
        """The forward pass of a decode-only step of num_rows rows on the static buffers, its
        metadata bounded by max_model_len (every step a graph replays stays within it)."""
        input_ids, positions, meta, _ = self.buffers.views(
            num_rows, num_rows, 0, 1, self.max_model_len, self.block_size
        )
        self.backend.prepare(meta)
        return self.runtime.forward(input_ids, positions, self.kv_caches, meta, self.backend), meta

    def _decode_bucket(self, out: SchedulerOutput) -> int | None:
        """The bucket a decode-only step is padded to (None: not padded)."""
        if not self.decode_sizes or out.total_num_tokens != len(out.scheduled):
            return None
        return bucket_for(self.decode_sizes, len(out.scheduled))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one step: the sampled tokens, and the logprobs of the requests that ask."""
        self._update_states(out)
        if out.is_empty:
            return RunnerOutput()
        for s in out.scheduled:
            if s.kv_copy is not None:
                src, dst, n = s.kv_copy
                for cache in self.kv_caches:  # [2, blocks, block_size, kv heads, head dim]
                    cache[:, dst, :n] = cache[:, src, :n]
        bucket = self._decode_bucket(out)
        input_ids, positions, meta, logits_indices = self.prepare_inputs(out)
        selected = False  # hidden holds only the rows the head reads
        if bucket is not None and self.graphs is not None:
            hidden = self.graphs.replay(bucket)
        else:
            self.backend.prepare(meta)
            # the model skips what only other rows need, unless prompts are scored (every row)
            selected = not self.prompt_scorer and len(logits_indices) < len(input_ids)
            wanted = logits_indices if selected else None
            hidden = self.runtime.forward(
                input_ids, positions, self.kv_caches, meta, self.backend, wanted
            )
        prompt_logprobs = (
            self.prompt_scorer.score(out, hidden, self._prompt_of, self.model.compute_logits)
            if self.prompt_scorer
            else {}
        )
        sampling = [s for s in out.scheduled if s.will_sample]
        if not sampling:
            return RunnerOutput(prompt_logprobs=prompt_logprobs)
        rows = []
        for s in sampling:
            info = self.infos[s.request_id]
            tokens = self.rows[s.request_id].token_ids
            rows.append(
                SamplingRow(
                    params=info.params,
                    token_ids=tokens,
                    prompt_len=info.prompt_len,
                    generator=self.generators.get(s.request_id),
                    stop_ids_for_min_tokens=info.stop_ids_for_min_tokens,
                    bad_words_token_ids=info.bad_words_token_ids,
                    grammar=info.grammar,
                    seed=info.seed,
                    draws=self.draws.get(s.request_id, 0),
                )
            )
        sampled, logprobs = self._sample(hidden if selected else hidden[logits_indices], rows)
        result = {}
        grammar_done = []
        for s, row, token in zip(sampling, rows, sampled, strict=True):
            state = self.rows[s.request_id]
            state.token_ids.append(token)
            if s.request_id in self.draws:  # a device draw was made: the next one is new
                self.draws[s.request_id] += 1
                self.row_draws[state.row] += 1
            result[s.request_id] = token
            if row.grammar is not None:
                row.grammar.accept(token)
                if row.grammar.finished:
                    grammar_done.append(s.request_id)
        return RunnerOutput(
            result,
            {s.request_id: lp for s, lp in zip(sampling, logprobs, strict=True) if lp is not None},
            prompt_logprobs,
            tuple(grammar_done),
        )

    def _prompt_of(self, request_id: str) -> tuple[list[int], int, int]:
        info = self.infos[request_id]
        return self.rows[request_id].token_ids, info.prompt_len, info.params.prompt_logprobs or 0

    def _sample(
        self, hidden: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[list[int], list[PositionLogprobs | None]]:
        """One token per row, and its logprobs for the rows that ask. Rows the exact head (bf16
        or int16 logits) answers exactly (plain greedy, plain temperature sampling, no logprobs, no logit_bias /
        allowed_token_ids / bad_words: the head makes no float32 logits) go through it; the
        others, and any row it hands back, through the float32 logits and the sampler. The path depends on the row alone, so a seeded request
        draws the same tokens whatever shares its batch. With device draws only plain greedy
        rows take the head (its sampled rows would draw on the host)."""
        head = self.runtime.exact_head
        tokens = [-1] * len(rows)
        logprobs: list[PositionLogprobs | None] = [None] * len(rows)
        if head is not None:
            vocab = self.model.head_weight.shape[0]
            fast = [
                i
                for i, r in enumerate(rows)
                if r.params.logprobs is None
                and (
                    r.plain_argmax
                    or (not self.device_draws and r.plain_draw(vocab, head.MIN_TEMPERATURE))
                )
            ]
            if fast:
                params = [rows[i].params for i in fast]
                temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params])
                seeds = torch.tensor(
                    [
                        0 if p.greedy else _draw_seed(rows[i].generator)
                        for i, p in zip(fast, params, strict=True)
                    ]
                )
                got = head(hidden if len(fast) == len(rows) else hidden[fast], temperature, seeds)
                for i, token in zip(fast, got.tolist(), strict=True):
                    tokens[i] = token
        rest = [i for i, token in enumerate(tokens) if token < 0]
        if rest:
            logits = self.model.compute_logits(hidden if len(rest) == len(rows) else hidden[rest])
            asking = [j for j, i in enumerate(rest) if rows[i].params.logprobs is not None]
            raw = logits[asking] if asking else None  # a copy: the sampler works in place
            staged = self.staged_sampling
            if staged is not None and len(rest) < len(rows):
                staged = staged.select(torch.tensor(rest, device=logits.device))
            picked = self.sampler(logits, [rows[i] for i in rest], staged)
            for i, token in zip(rest, picked, strict=True):
                tokens[i] = token
            if raw is not None:
                picked = [rest[j] for j in asking]
                measured = position_logprobs(
                    raw,
                    [tokens[i] for i in picked],
                    [rows[i].params.logprobs or 0 for i in picked],
                )
                for i, lp in zip(picked, measured, strict=True):
                    logprobs[i] = lp
        return tokens, logprobs


def _draw_seed(generator: torch.Generator | None) -> int:
    """A 62-bit seed for one step's draw through the bf16 head, from the request's generator."""
    return int(torch.randint(0, 1 << 62, (1,), generator=generator, device="cpu"))
