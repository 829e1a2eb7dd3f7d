"""The step's inputs in static buffers, and decode-only steps padded to a CUDA graph's batch
size: what a graph would capture and replay, checked on the CPU (the padded path runs eagerly
here, with the torch backend, whose plan reads the buffers anew each step)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from cbgen.attention import AttentionMetadata
from cbgen.config import EngineConfig
from cbgen.engine.cuda_graphs import bucket_for, capture_sizes, graphs_unavailable
from cbgen.engine.engine import Engine
from cbgen.engine.runner import ModelRunner
from cbgen.engine.sampler import Sampler, SamplingRow, SamplingTensors
from cbgen.engine.step_inputs import PAD_SLOT
from cbgen.sampling_params import SamplingParams

MAX_NUM_SEQS = 13  # buckets 1, 2, 4, 8, 13: most batch sizes of the runs below are padded


def make_engine(folder: Path, **overrides: Any) -> Engine:
    config = dict(
        model=str(folder),
        device="cpu",
        dtype="float32",
        attention_backend="torch",
        kv_cache_memory=4 << 20,
        block_size=4,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=64,
        num_threads=1,
    )
    return Engine(EngineConfig(**{**config, **overrides}))


def run(engine: Engine, count: int = 12) -> dict[str, list[int]]:
    """Greedy requests of different prompt and output lengths, so that decode batches shrink
    through sizes that are no bucket as they finish."""
    for i in range(count):
        prompt = [(7 * i + 3 * j) % 250 + 1 for j in range(5 + (3 * i) % 11)]
        params = SamplingParams(max_tokens=3 + (5 * i) % 17, temperature=0, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step().finished:
            done[o.request_id] = o.output_token_ids
    return done


class StepSpy:
    """Records, for every step a runner prepares, the real and padded row counts and the
    device tensors it hands the forward pass."""

    def __init__(self, runner: ModelRunner) -> None:
        self.steps: list[tuple[int, int, tuple[torch.Tensor, torch.Tensor, AttentionMetadata]]] = []
        prepare = runner.prepare_inputs

        def spy(out: Any) -> Any:
            result = prepare(out)
            self.steps.append((len(out.scheduled), result[2].seq_lens.shape[0], result[:3]))
            return result

        runner.prepare_inputs = spy  # type: ignore[method-assign]

    @property
    def padded(self) -> list[tuple[int, int]]:
        return [(b, n) for b, n, _ in self.steps if n > b]


def test_buckets_are_vllms_sizes_and_a_step_takes_the_smallest_that_holds_it() -> None:
    assert capture_sizes(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert capture_sizes(37) == (1, 2, 4, 8, 16, 24, 32, 37)
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(1) == (1,)
    sizes = capture_sizes(256)
    assert len(sizes) == 35 and sizes[-1] == 256
    assert [bucket_for(sizes, b) for b in (1, 3, 5, 8, 9, 17, 255)] == [1, 4, 8, 8, 16, 24, 256]
    assert bucket_for(sizes, 257) is None


def test_graphs_only_on_cuda_with_a_capturable_backend_and_not_eager() -> None:
    cuda = torch.device("cuda")
    assert graphs_unavailable(cuda, "triton", enforce_eager=False) is None
    assert graphs_unavailable(cuda, "triton", enforce_eager=True) == "enforce_eager"
    assert "torch" in (graphs_unavailable(cuda, "torch", False) or "")
    assert "flash" in (graphs_unavailable(cuda, "flash", False) or "")
    assert "cpu" in (graphs_unavailable(torch.device("cpu"), "triton", False) or "")


def test_padded_decode_steps_give_the_tokens_of_unpadded_ones(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    folder = tiny_model_dir("llama")
    plain = make_engine(folder)
    expected = run(plain)
    padded = make_engine(folder)
    padded.runner.pad_decodes(capture_sizes(MAX_NUM_SEQS))
    spy = StepSpy(padded.runner)
    assert run(padded) == expected
    # padding happened, at several batch sizes that are no bucket
    assert {b for b, _ in spy.padded} >= {3, 5, 9, 12}
    assert all(n == bucket_for(capture_sizes(MAX_NUM_SEQS), b) for b, n in spy.padded)


def test_replaying_the_capture_batch_gives_the_eager_tokens(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    """A graph replays the forward pass it captured: on the static buffers, with the metadata
    of the capture (max_seq_len = max_model_len), whatever the step. Standing in for the
    replay, the runner's own capture forward reads only what the buffers hold."""
    folder = tiny_model_dir("llama")
    expected = run(make_engine(folder))
    engine = make_engine(folder)
    runner = engine.runner

    class Replay:
        def __init__(self) -> None:
            self.sizes = capture_sizes(MAX_NUM_SEQS)
            self.replayed: list[int] = []

        def replay(self, size: int) -> torch.Tensor:
            self.replayed.append(size)
            hidden, meta = runner._padded_forward(size)
            assert meta.max_seq_len == runner.max_model_len
            return hidden

    replay = Replay()
    runner.pad_decodes(replay.sizes)
    runner.graphs = replay  # type: ignore[assignment]
    assert run(engine) == expected
    assert len(replay.replayed) > 10 and set(replay.replayed) >= {4, 8, 13}


def test_padding_rows_never_write_a_real_sequences_kv(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    """Every KV slot a padded step changes is one of its real tokens' slots."""
    engine = make_engine(tiny_model_dir("llama"))
    runner = engine.runner
    runner.pad_decodes(capture_sizes(MAX_NUM_SEQS))
    spy = StepSpy(runner)
    execute = runner.execute
    checked = 0

    def checking(out: Any) -> Any:
        nonlocal checked
        before = [c.clone() for c in runner.kv_caches]
        result = execute(out)
        if spy.steps and spy.steps[-1][1] > spy.steps[-1][0] == len(out.scheduled):
            real, rows, (_, _, meta) = spy.steps[-1]
            slots = meta.slot_mapping.tolist()
            assert slots[real:] == [PAD_SLOT] * (rows - real)
            for old, new in zip(before, runner.kv_caches, strict=True):
                # [2, blocks, block_size, Hkv, D] -> the flat slots whose K or V changed
                changed = (old != new).any(0).flatten(0, 1).flatten(1).any(1)
                assert set(changed.nonzero().flatten().tolist()) == set(slots[:real])
            checked += 1
        return result

    runner.execute = checking  # type: ignore[method-assign]
    run(engine)
    assert checked > 10


def test_the_capture_batch_is_all_padding_and_writes_nothing(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    engine = make_engine(tiny_model_dir("llama"))
    runner = engine.runner
    before = [c.clone() for c in runner.kv_caches]
    with torch.inference_mode():
        runner._stage_padding(8)
        hidden, meta = runner._padded_forward(8)
    assert meta.slot_mapping.tolist() == [PAD_SLOT] * 8
    assert meta.query_start_loc.tolist() == list(range(9))
    assert meta.seq_lens.tolist() == [1] * 8
    assert hidden.shape[0] == 8 and bool(hidden.isfinite().all())
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))


@pytest.mark.parametrize("pad", [False, True])
def test_static_buffers_keep_their_addresses_and_the_block_table_its_width(
    tiny_model_dir: Callable[[str], Path], pad: bool
) -> None:
    engine = make_engine(tiny_model_dir("llama"))
    runner = engine.runner
    if pad:
        runner.pad_decodes(capture_sizes(MAX_NUM_SEQS))
    start = runner.buffers.data_ptrs()
    spy = StepSpy(runner)
    run(engine, count=16)  # more requests than slots: admissions and exits change B
    assert runner.buffers.data_ptrs() == start
    sizes = {b for b, _, _ in spy.steps}
    assert len(sizes) > 5
    width = runner.max_blocks_per_seq
    for _, _, (input_ids, positions, meta) in spy.steps:
        assert input_ids.data_ptr() == start["input_ids"]
        assert positions.data_ptr() == start["positions"]
        assert meta.slot_mapping.data_ptr() == start["slot_mapping"]
        assert meta.query_start_loc.data_ptr() == start["query_start_loc"]
        assert meta.seq_lens.data_ptr() == start["seq_lens"]
        assert meta.block_table.data_ptr() == start["block_table"]
        assert meta.block_table.shape[1] == width and meta.block_table.stride() == (width, 1)


def test_a_step_beyond_the_buffers_capacity_is_refused(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    engine = make_engine(tiny_model_dir("llama"))
    runner = engine.runner
    engine.add_request("r", list(range(1, 40)), SamplingParams(max_tokens=2))
    out = engine.scheduler.schedule(0.0)
    runner.buffers.max_num_tokens = 8  # as if the scheduler had overrun its budget
    with pytest.raises(ValueError, match="max_num_batched_tokens: a step of 39 tokens"):
        runner.execute(out)


SAMPLED = [
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=1, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.7, top_p=0.8, seed=2, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=1.2, top_k=5, min_p=0.05, seed=3, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.5, top_k=-1, top_p=0.95, seed=4, max_tokens=6, ignore_eos=True),
]


def test_staged_sampling_parameters_give_the_samplers_own_draws() -> None:
    """The sampler given the rows' parameters as device tensors (in any subset of rows) draws
    what it draws when it makes them from the rows itself."""
    vocab = 64
    logits = torch.randn(len(SAMPLED), vocab, generator=torch.Generator().manual_seed(0))

    def rows() -> list[SamplingRow]:
        return [
            SamplingRow(p, [1, 2, 3], 3, torch.Generator().manual_seed(10 + i), ())
            for i, p in enumerate(SAMPLED)
        ]

    staged = SamplingTensors(
        torch.tensor([p.temperature for p in SAMPLED]),
        torch.tensor([p.top_k for p in SAMPLED]),
        torch.tensor([p.top_p for p in SAMPLED]),
        torch.tensor([p.min_p for p in SAMPLED]),
    )
    for _ in range(3):
        assert Sampler()(logits.clone(), rows(), staged) == Sampler()(logits.clone(), rows())
    sub = [1, 3]
    picked = [rows()[i] for i in sub]
    got = Sampler()(logits[sub].clone(), picked, staged.select(torch.tensor(sub)))
    assert got == Sampler()(logits[sub].clone(), [rows()[i] for i in sub])


def test_the_runner_stages_sampling_parameters_without_changing_a_token(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    folder = tiny_model_dir("llama")

    def sample(engine: Engine) -> dict[str, list[int]]:
        for i in range(10):
            engine.add_request(f"s{i}", [3 + i, 9, 27, 81 % 250], SAMPLED[i % len(SAMPLED)])
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step().finished:
                done[o.request_id] = o.output_token_ids
        return done

    staged = make_engine(folder)
    seen: list[SamplingTensors | None] = []
    call = staged.runner.sampler.__call__

    def spy(logits: torch.Tensor, rows: Any, tensors: SamplingTensors | None = None) -> Any:
        seen.append(tensors)
        return call(logits, rows, tensors)

    staged.runner.sampler = spy  # type: ignore[assignment]
    unstaged = make_engine(folder)
    unstaged.runner._stage_sampling = lambda request_ids: None  # type: ignore[method-assign]
    assert sample(staged) == sample(unstaged)
    assert seen and all(t is not None for t in seen)
