"""cbgen.runtime.cpu_decoder: a step's forward pass in one C call gives the Python forward's hidden
states bit for bit, for the models it serves, with the default build and the AVX2 one; the
steps and models it does not serve take the Python path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.models import tiny_engine

from cbgen.cpu import build, thresholds
from cbgen.llm import LLM
from cbgen.runtime.cpu import CpuRuntime
from cbgen.runtime.cpu_decoder import NativeDecoder
from cbgen.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(build.load_library() is None, reason=build.native_status())


def cpu_runtime(engine: Any) -> CpuRuntime:
    runtime = engine.runtime
    assert isinstance(runtime, CpuRuntime)
    return runtime


class Checked:
    """Stands in for a runtime's native decoder: every step it serves is run again by the
    Python forward (which writes the same K/V again), and the two hidden states must be equal."""

    def __init__(self, engine: Any) -> None:
        self.model = engine.runner.model
        self.backend = engine.runner.backend
        runtime = cpu_runtime(engine)
        native = runtime.decoder
        assert isinstance(native, NativeDecoder)
        self.native = native
        self.served: list[int] = []  # tokens of each step served
        self.declined = 0
        runtime.decoder = self  # type: ignore[assignment]

    def __call__(
        self, input_ids: Any, positions: Any, kv_caches: Any, meta: Any, bf16_dots: bool = False
    ) -> Any:
        got = self.native(input_ids, positions, kv_caches, meta, bf16_dots)
        if got is None:
            self.declined += 1
            return None
        want = self.model.forward_layers(input_ids, positions, kv_caches, meta, self.backend)
        assert torch.equal(got, want), (got - want).abs().max()
        self.served.append(input_ids.shape[0])
        return got


PROMPTS = [[1, 5, 9, 200, 17], list(range(30, 70)), [100, 3, 77, 42, 42, 9, 250, 17], [7] * 19]


def _generate(engine: Any, prompts: list[list[int]], **params: Any) -> list[list[int]]:
    sampling = SamplingParams(**{"temperature": 0, "max_tokens": 20, "ignore_eos": True, **params})
    return [o.output_token_ids for o in LLM(engine=engine).generate(prompts, sampling)]


@pytest.mark.usefixtures("each_build")
@pytest.mark.parametrize(
    "kind", ["llama", "qwen2", "qwen3", "phi3", "phi3_longrope", "gemma2", "gemma3"]
)
def test_one_c_call_gives_the_python_forwards_hidden_states_bit_for_bit(
    kind: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    """Decodes and small prompt chunks (with and without cached context) in mixed steps;
    GQA, QKV bias (qwen2), q/k norms and an explicit head_dim (qwen3), a sliding window in every
    layer (phi3), LongRoPE's scaled tables; Gemma's embedding scale, block-output norms, GeGLU,
    soft-capped scores and sliding layers (gemma2), q/k norms and local RoPE tables (gemma3)."""
    engine = tiny_engine(tiny_model_dir(kind), max_num_batched_tokens=24)
    checked = Checked(engine)
    tokens = _generate(engine, PROMPTS) + _generate(engine, PROMPTS[:2], temperature=1.0, seed=3)
    assert all(len(t) == 20 for t in tokens)
    assert checked.declined == 0
    assert len(checked.served) > 20 and max(checked.served) == 24 and min(checked.served) == 1
    assert checked.native.calls == len(checked.served)


@pytest.mark.usefixtures("each_build")
@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("llama", {}),
        ("phi3", {}),
        ("gemma2", {}),
        ("phi3", {"kv_cache_dtype": "bfloat16"}),  # widened from the bf16 cache
        ("gemma2", {"dtype": "bfloat16"}),  # bf16 dot products where the build has them
    ],
)
def test_prompt_chunks_take_the_prefill_kernel_inside_the_call(
    kind: str, options: dict[str, Any], tmp_path: Path
) -> None:
    """Heads of 64 (the prefill kernel's): the prompt chunks of mixed steps go to the prefill
    kernel inside the one call, over their keys gathered from the cache (from the window's
    first block on, behind zero rows up to a whole softmax step: phi3's window of 48 and
    gemma2's sliding layers; a bf16 cache's rows widened, or as they are with bf16 dot
    products), with the Python path's bits. One-token chunks of a prompt too."""
    from helpers.models import make_tiny_hf_model

    folder = make_tiny_hf_model(kind, tmp_path, head_dim=64, sliding_window=48)
    engine = tiny_engine(folder, max_num_batched_tokens=24, **options)
    checked = Checked(engine)
    prompts = [*PROMPTS, list(range(3, 120)), [9] * 70]
    tokens = _generate(engine, prompts, max_tokens=40)
    tokens += _generate(engine, [[5, *p] for p in prompts[-2:]], max_tokens=40)  # cached blocks
    assert all(len(t) == 40 for t in tokens)
    assert checked.declined == 0 and checked.native.prompt_calls > 5
    assert checked.native.calls == len(checked.served) and min(checked.served) == 1
    plain = tiny_engine(folder, max_num_batched_tokens=24, **options)
    cpu_runtime(plain).decoder = None
    assert _generate(plain, prompts, max_tokens=40) == tokens[: len(prompts)]


@pytest.mark.usefixtures("each_build")
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_steps_past_the_row_blocks_apply_the_activation_on_the_tiles_with_the_same_bits(
    kind: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    """From small_gemm's row blocks on, the one-call step applies SiLU x up (GELU x up) to the
    gate-up matmul's tiles (cbgen_small_gemm_gated_f32) instead of a second pass: the row
    blocks start at 8 rows here, so most steps take it, and the smaller ones the two passes."""
    engine = tiny_engine(tiny_model_dir(kind), max_num_batched_tokens=24)
    checked = Checked(engine)
    cpu_runtime(engine).thresholds.blocked_rows = 8
    tokens = _generate(engine, PROMPTS)
    assert all(len(t) == 20 for t in tokens) and checked.declined == 0
    assert max(checked.served) >= 8 and min(checked.served) < 8


@pytest.mark.usefixtures("each_build")
def test_steps_with_a_chunk_for_the_prefill_kernel_take_the_python_path(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt chunk the attention's decode kernel does not take (more K/V rows than
    prefill_split allows), and a batch past small_gemm's rows, run the Python forward; the
    tokens are those of an engine without the native decoder."""
    folder = tiny_model_dir("llama")
    monkeypatch.setattr(thresholds, "prefill_split", lambda: (40, True))
    engine = tiny_engine(folder, max_num_batched_tokens=24)
    cpu_runtime(engine).thresholds.small_gemm_max_rows = 6
    checked = Checked(engine)
    got = _generate(engine, PROMPTS)
    assert checked.declined > 0 and checked.served and max(checked.served) <= 6
    plain = tiny_engine(folder, max_num_batched_tokens=24)
    cpu_runtime(plain).thresholds.small_gemm_max_rows = 6
    cpu_runtime(plain).decoder = None
    assert _generate(plain, PROMPTS) == got


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "phi4_mini"])
def test_models_it_does_not_serve_keep_the_python_forward(
    kind: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    """Experts and partial rotary are not in the C pass."""
    engine = tiny_engine(tiny_model_dir(kind))
    assert cpu_runtime(engine).decoder is None
    assert "decode steps: layer by layer" in engine.describe()
    assert len(_generate(engine, PROMPTS[:1])[0]) == 20


def test_weights_kept_in_bf16_take_the_one_call_through_the_widened_matmul(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    """bf16 weights under float32 arithmetic: the C pass multiplies through small_gemm_bf16
    widened (weights 1), with the Python forward's hidden states bit for bit."""
    engine = tiny_engine(tiny_model_dir("llama"), cpu_weight_dtype="bfloat16")
    native = cpu_runtime(engine).decoder
    assert isinstance(native, NativeDecoder) and native.weights == 1
    checked = Checked(engine)
    assert all(len(t) == 20 for t in _generate(engine, PROMPTS))
    assert checked.declined == 0 and len(checked.served) > 10


@pytest.mark.usefixtures("each_build")
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
@pytest.mark.parametrize("dot", [False, True], ids=["widened", "dot"])
def test_bf16_panels_take_the_gated_forms_in_the_one_call(
    kind: str, dot: bool, tiny_model_dir: Callable[[str], Path]
) -> None:
    """bf16 panels' gate-up with its activation on the tiles in the C pass: with dot products
    (--dtype bfloat16 where the build has them) at every step, widened from the row blocks on
    (8 rows here): the Python forward's hidden states bit for bit."""
    from cbgen.cpu import bf16

    if dot and not bf16.native():
        pytest.skip("no bf16 dot products in this build")
    options: dict[str, Any] = {"dtype": "bfloat16"} if dot else {"cpu_weight_dtype": "bfloat16"}
    engine = tiny_engine(tiny_model_dir(kind), max_num_batched_tokens=24, **options)
    checked = Checked(engine)
    assert checked.native.weights == (2 if dot else 1)
    cpu_runtime(engine).thresholds.blocked_rows = 8
    assert all(len(t) == 20 for t in _generate(engine, PROMPTS))
    assert checked.declined == 0 and max(checked.served) >= 8 and min(checked.served) < 8


def test_a_slot_past_the_cache_is_refused_before_anything_is_written(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    """A kernel that refuses ends the call with nothing the Python path would not redo: here
    the K/V write of the first layer, which checks every slot before it writes one."""
    engine = tiny_engine(tiny_model_dir("llama"))
    runner = engine.runner
    native = cpu_runtime(engine).decoder
    assert isinstance(native, NativeDecoder)
    _generate(engine, PROMPTS[:1])
    calls = native.calls
    assert calls > 0
    caches = [c.clone() for c in runner.kv_caches]
    meta = _one_decode_meta(runner, slot=runner.kv_caches[0].shape[1] * 4)
    runner.backend.prepare(meta)
    ids, pos = torch.tensor([5]), torch.tensor([3])
    assert native(ids, pos, runner.kv_caches, meta) is None
    assert native.calls == calls
    assert all(torch.equal(a, b) for a, b in zip(caches, runner.kv_caches, strict=True))
    meta = _one_decode_meta(runner, slot=7)  # a slot in the cache
    runner.backend.prepare(meta)
    assert native(ids, pos, runner.kv_caches, meta) is not None
    assert not torch.equal(caches[0], runner.kv_caches[0])


def _one_decode_meta(runner: Any, slot: int) -> Any:
    from cbgen.attention.base import AttentionMetadata

    return AttentionMetadata(
        slot_mapping=torch.tensor([slot]),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([4], dtype=torch.int32),
        block_table=torch.tensor([[0, 1]], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=4,
        block_size=runner.block_size,
    )


def test_the_real_model_runs_its_decode_steps_in_one_call(smollm2_engine: Any) -> None:
    """SmolLM2 (the token-exact tests against transformers run through it) takes the C pass."""
    native = cpu_runtime(smollm2_engine).decoder
    assert isinstance(native, NativeDecoder)
    assert "decode steps: one C call each" in smollm2_engine.describe()
    before = native.calls
    out = _generate(smollm2_engine, [[1, 9690, 28, 2], [1, 504, 3458, 314, 253]], max_tokens=4)
    assert [len(t) for t in out] == [4, 4]
    assert native.calls >= before + 4
