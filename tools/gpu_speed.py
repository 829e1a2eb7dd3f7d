"""The memory and speed sections of the GPU check (tools/gpu_check.py runs them, each against its
own time budget; the sections share tools.gpu_context.CheckContext):

    memory        the measured peak stays inside gpu_memory_utilization x total memory
    graphs        greedy tokens with CUDA graphs for decode steps equal those with
                  enforce_eager; decode steps timed both ways at several batch sizes
    throughput    cbgen against transformers' continuous batching (generate_batch) on one
                  ShareGPT-like workload; a SmolLM2-135M-shape decode step at batch 256
    roofline_8b   a Llama-8B-shape decode step at batch 256, context 512, against the time to
                  read its weights and KV once at 4.3 TB/s

Each puts what it measures into ctx.figures as it goes and returns whether it passed.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import torch

from cbgen.attention import get_attention_backend
from cbgen.engine.cuda_graphs import capture_sizes
from cbgen.engine.engine import Engine
from cbgen.llm import LLM
from cbgen.models.config import BUILTIN_SHAPES
from cbgen.models.triton_ops import TritonOps
from cbgen.sampling_params import SamplingParams
from tools.gpu_context import (
    HBM_BYTES_PER_S,
    CheckContext,
    GiB,
    common_prefix,
    hf_model,
    vocab_size,
)
from tools.gpu_fixtures import (
    decode_batch,
    decode_bytes_read,
    kv_caches,
    random_model,
    sharegpt_like_prompts,
    time_decode_step,
)

# ---- memory ----------------------------------------------------------------------------------


def memory(ctx: CheckContext) -> bool:
    """An engine at gpu_memory_utilization 0.5 sizes its KV cache by profiling, then runs steps
    at the full token budget: torch's peak plus the memory outside torch stays inside the budget."""
    if not ctx.cuda:
        ctx.figures["skipped"] = "needs CUDA"
        return True
    ctx.free()
    util = 0.5
    path = ctx.checkpoint("smollm2-135m", torch.bfloat16)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    engine = ctx.engine(
        path, "bfloat16", kv_cache_memory=None, gpu_memory_utilization=util, max_num_seqs=256
    )
    prompts = sharegpt_like_prompts(256, vocab_size(ctx, "smollm2-135m"), seed=3)
    LLM(engine=engine).generate(
        prompts, SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    )
    ctx.sync()
    free, total = torch.cuda.mem_get_info(ctx.device)
    outside = max(0, (total - free) - torch.cuda.memory_reserved(ctx.device))
    peak = torch.cuda.max_memory_reserved(ctx.device) + outside
    budget = util * total
    ctx.figures.update(
        budget_gib=budget / GiB,
        peak_gib=peak / GiB,
        peak_reserved_gib=torch.cuda.max_memory_reserved(ctx.device) / GiB,
        peak_allocated_gib=torch.cuda.max_memory_allocated(ctx.device) / GiB,
        outside_torch_gib=outside / GiB,
        kv_cache_gib=engine.num_blocks * engine.kv_bytes_per_block / GiB,
        weights_gib=sum(p.numel() * p.element_size() for p in engine.model.parameters()) / GiB,
        engine_plan_gib={k: v / GiB for k, v in engine.memory_plan.items()},
        within_budget=peak <= budget,
    )
    return peak <= budget


# ---- throughput ------------------------------------------------------------------------------


def _run_cbgen(
    engine: Engine, warm: list[list[int]], prompts: list[list[int]], out_len: int
) -> dict[str, float]:
    """A warm-up workload of the same kind (other prompts: no prefix-cache hits), which compiles
    every kernel variant the timed one meets (split-KV counts vary as the batch drains), then
    the timed workload."""
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    t0 = time.perf_counter()
    LLM(engine=engine).generate(warm, params)
    cold = time.perf_counter() - t0
    for i, p in enumerate(prompts):
        engine.add_request(f"timed-{i}", p, params)
    t0 = time.perf_counter()
    decode_ms, outputs, steps, cached = [], 0, 0, 0
    while engine.has_unfinished_requests():
        out = engine.step()
        steps += 1
        outputs += sum(o.num_output_tokens for o in out.finished)
        cached += out.stats.num_cached_tokens
        if out.stats.num_prefill_tokens == 0:
            decode_ms.append(1000 * out.stats.duration_s)
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "warm_up_wall_s": cold,
        "total_tok_s": (outputs + sum(map(len, prompts))) / wall,
        "output_tokens": outputs,
        "prompt_tokens_from_prefix_cache": cached,
        "steps": steps,
        "median_decode_step_ms": statistics.median(decode_ms) if decode_ms else 0.0,
    }


def _run_transformers_cb(
    model: Any,
    warm: list[list[int]],
    prompts: list[list[int]],
    out_len: int,
    max_seqs: int,
    max_tokens: int,
) -> dict[str, float]:
    """generate_batch with a paged cache sized for every request at once; one max_new_tokens
    for all (it takes no per-request length), end of sequence never stops a request. A short
    warm-up first builds the manager and captures its CUDA graphs; the timed call reuses it."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(
        logging.ERROR
    )  # persistent_manager's notice
    page = 256
    longest = max(map(len, prompts + warm)) + out_len
    cb = ContinuousBatchingConfig(
        num_blocks=len(prompts) * -(-longest // page) + 8,
        max_batch_tokens=max_tokens,
        max_requests_per_batch=max_seqs,
    )
    gen = GenerationConfig(do_sample=False, max_new_tokens=out_len, eos_token_id=-1, pad_token_id=0)
    model.generate_batch(
        inputs=sorted(warm, key=len)[-8:],  # the longest: the manager is sized by them
        generation_config=gen,
        continuous_batching_config=cb,
        persistent_manager=True,
    )
    t0 = time.perf_counter()
    out = model.generate_batch(
        inputs=prompts,
        generation_config=gen,
        continuous_batching_config=cb,
        persistent_manager=True,
    )
    wall = time.perf_counter() - t0
    if hasattr(model, "destroy_cached_continuous_batching_manager"):
        model.destroy_cached_continuous_batching_manager()
    outputs = sum(len(o.generated_tokens) for o in out.values())
    return {
        "wall_s": wall,
        "total_tok_s": (outputs + sum(map(len, prompts))) / wall,
        "output_tokens": outputs,
    }


def throughput(ctx: CheckContext) -> bool:
    """One ShareGPT-like workload (prompt lengths as ShareGPT's, fixed output length) through
    cbgen and through transformers' continuous batching, bfloat16, same weights; then the
    SmolLM2-135M-shape decode step at batch 256, context 512."""
    name = "smollm2-135m"
    path = ctx.checkpoint(name, torch.bfloat16)
    num, out_len, seqs, longest = (8, 4, 8, 64) if ctx.quick else (256, 128, 256, 1024)
    prompts = sharegpt_like_prompts(num, vocab_size(ctx, name), seed=0, max_len=longest)
    warm = sharegpt_like_prompts(num, vocab_size(ctx, name), seed=1, max_len=longest)
    budget = 2048
    f = ctx.figures
    f.update(requests=num, output_len=out_len, prompt_tokens=sum(map(len, prompts)))
    engine = ctx.engine(
        path,
        "bfloat16",
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        max_model_len=2048,
        kv_cache_memory=(64 << 20) if ctx.quick else 16 * GiB,
    )
    f["cbgen"] = {"backend": engine.backend.name, **_run_cbgen(engine, warm, prompts, out_len)}
    batch, context = (8, 32) if ctx.quick else (256, 512)
    step = decode_batch(batch, context, engine.config.block_size, vocab_size(ctx, name), ctx.device)
    caches = kv_caches(
        engine.model_config, step.num_blocks, engine.config.block_size, engine.dtype, ctx.device
    )
    for graph in [False, True] if ctx.cuda else [False]:
        f[f"decode_step_ms_b{batch}_ctx{context}_{'graphs' if graph else 'eager'}"] = (
            1000
            * time_decode_step(
                engine.model,
                engine.backend,
                caches,
                step,
                ctx.sync,
                iters=5 if ctx.quick else 20,
                graph=graph,
            )
        )
    del engine, caches
    ctx.free()
    missing = _transformers_cb_missing()
    if missing is not None:  # its API moved within 5.x: a figure we lack, not a failure
        f["transformers_cb"] = f"not available: {missing}"
        return True
    hf = hf_model(path, torch.bfloat16, ctx.device)
    f["transformers_cb"] = _run_transformers_cb(hf, warm, prompts, out_len, seqs, budget)
    del hf
    ctx.free()
    f["vs_transformers_cb"] = f["cbgen"]["total_tok_s"] / f["transformers_cb"]["total_tok_s"]
    return True


def _transformers_cb_missing() -> str | None:
    """Why transformers' continuous batching cannot run as _run_transformers_cb calls it
    (None: it can): ContinuousBatchingConfig and generate_batch's keywords."""
    import inspect

    import transformers

    if not hasattr(transformers, "ContinuousBatchingConfig"):
        return f"transformers {transformers.__version__} has no ContinuousBatchingConfig"
    cfg = inspect.signature(transformers.ContinuousBatchingConfig).parameters
    absent = [
        k for k in ("num_blocks", "max_batch_tokens", "max_requests_per_batch") if k not in cfg
    ]
    try:
        from transformers.generation.continuous_batching import ContinuousMixin

        batch = inspect.signature(ContinuousMixin.generate_batch).parameters
    except (ImportError, AttributeError) as e:
        return f"transformers {transformers.__version__}: no generate_batch ({e})"
    absent += [
        k
        for k in ("inputs", "generation_config", "continuous_batching_config", "persistent_manager")
        if k not in batch
    ]
    if absent:
        return f"transformers {transformers.__version__} lacks {', '.join(absent)}"
    return None


# ---- graphs ---------------------------------------------------------------------------------


def _decode_run(
    engine: Engine, prompts: list[list[int]], lengths: list[int], tag: str
) -> tuple[list[list[int]], list[float]]:
    """Greedy tokens of each prompt (max_tokens from lengths), and the duration (ms) of every
    decode-only step. tag: the request ids' prefix, new for each run of an engine."""
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        engine.add_request(f"{tag}{i}", p, params)
    tokens: dict[str, list[int]] = {}
    decode_ms = []
    while engine.has_unfinished_requests():
        out = engine.step()
        if out.stats.num_prefill_tokens == 0:
            decode_ms.append(1000 * out.stats.duration_s)
        tokens.update((o.request_id, o.output_token_ids) for o in out.finished)
    return [tokens[f"{tag}{i}"] for i in range(len(prompts))], decode_ms


def graphs(ctx: CheckContext) -> bool:
    """Float32 greedy tokens with decode steps replayed from CUDA graphs equal those of an
    enforce_eager engine on the same weights (output lengths differ, so decode batches shrink
    through sizes that are no bucket and get padded); then decode steps of the SmolLM2-135M
    shape in bfloat16, timed both ways at several batch sizes (median engine step while every
    request decodes). On the CPU, which has no graphs, padded eager steps stand in for them."""
    f = ctx.figures
    name = next(iter(ctx.shapes()))
    num, out_len, seqs = (6, 6, 8) if ctx.quick else (40, 48, 32)
    prompts = sharegpt_like_prompts(
        num, vocab_size(ctx, name), seed=5, max_len=12 if ctx.quick else 200
    )
    lengths = [out_len // 2 + (7 * i) % (out_len // 2 + 1) for i in range(num)]
    # max_model_len 256: a capture picks split-KV for max_model_len, an eager step for its
    # longest context; at 256 both take one split, so the two runs launch the same kernels
    base = ctx.engine(ctx.checkpoint(name), "float32", max_num_seqs=seqs, max_model_len=256)
    eager = Engine(base.config.replace(enforce_eager=True), share_weights_with=base)
    replays = _count_replays(base, seqs)
    with_graphs, _ = _decode_run(base, prompts, lengths, "g")
    without, _ = _decode_run(eager, prompts, lengths, "g")
    same = sum(a == b for a, b in zip(with_graphs, without, strict=True))
    prefix = sum(common_prefix(a, b) for a, b in zip(with_graphs, without, strict=True)) / num
    f.update(
        model=name,
        decode_steps=base.describe().rsplit("decode steps: ", 1)[-1]
        if ctx.cuda
        else "padded eager",
        identical=f"{same}/{num}",
        mean_common_prefix=prefix,
        replayed_steps=replays["steps"],
        padded_steps=replays["padded"],
        graphs_off=base.graphs_off,
    )
    # a capture that failed falls back to eager steps: on CUDA the graphs must have replayed
    passed = same == num and replays["padded"] > 0 and (replays["steps"] > 0 or not ctx.cuda)
    del base, eager
    ctx.free()
    # timing: the throughput model, short prompts, every request decoding
    path = ctx.checkpoint("smollm2-135m", torch.bfloat16)
    sizes = (1, 4) if ctx.quick else (1, 8, 64, 256)
    timed = ctx.engine(path, "bfloat16", max_num_seqs=sizes[-1], max_model_len=1024)
    untimed = Engine(timed.config.replace(enforce_eager=True), share_weights_with=timed)
    vocab = vocab_size(ctx, "smollm2-135m")
    steps_ms: dict[str, dict[str, float]] = {}
    for b in sizes:
        prompts = sharegpt_like_prompts(b, vocab, seed=6, max_len=32)
        n = 4 if ctx.quick else 24
        row = {}
        default = "graphs" if timed.runner.graphs is not None else "default"
        for label, engine in ((default, timed), ("eager", untimed)):
            _decode_run(engine, prompts[:1], [2], f"w{b}-")  # warm: nothing compiles later
            _, ms = _decode_run(engine, prompts, [n] * b, f"t{b}-")
            row[f"{label}_ms"] = statistics.median(ms)
        row["speedup"] = row["eager_ms"] / row[f"{default}_ms"]
        steps_ms[f"b{b}"] = row
        if ctx.left() < 10:
            break
    f["decode_step"] = steps_ms
    del timed, untimed
    ctx.free()
    return passed


def _count_replays(engine: Engine, seqs: int) -> dict[str, int]:
    """Counts of the engine's graph replays and padded decode steps, as they happen; on the
    CPU the runner pads decode steps to the buckets and runs them eagerly."""
    runner = engine.runner
    counts = {"steps": 0, "padded": 0}
    if runner.graphs is None:
        runner.pad_decodes(capture_sizes(seqs))
    else:
        replay = runner.graphs.replay

        def counting(size: int) -> torch.Tensor:
            counts["steps"] += 1
            return replay(size)

        runner.graphs.replay = counting  # type: ignore[method-assign]
    prepare = runner.prepare_inputs

    def padded(out: Any) -> Any:
        result = prepare(out)
        counts["padded"] += result[2].seq_lens.shape[0] > len(out.scheduled)
        return result

    runner.prepare_inputs = padded  # type: ignore[method-assign]
    return counts


# ---- roofline_8b -----------------------------------------------------------------------------


def roofline_8b(ctx: CheckContext) -> bool:
    """Measured decode step over the time to read weights + KV once at 4.3 TB/s (dummy bf16
    weights drawn on the device; the quick mode times a toy shape at a toy batch instead)."""
    shape, batch, context = ("tiny-llama", 8, 32) if ctx.quick else ("llama-8b", 256, 512)
    cfg = BUILTIN_SHAPES[shape]
    dtype = torch.bfloat16
    ctx.free()
    model = random_model(cfg, dtype, ctx.device, context + 16)
    if ctx.cuda:
        model.ops = TritonOps()  # as load_model gives every CUDA model
    backend = get_attention_backend("auto", ctx.device, dtype, 16)
    step = decode_batch(batch, context, 16, cfg.vocab_size, ctx.device)
    caches = kv_caches(cfg, step.num_blocks, 16, dtype, ctx.device)
    read = decode_bytes_read(cfg, batch, context, dtype)
    roof = read / HBM_BYTES_PER_S
    f = ctx.figures
    f.update(
        shape=shape,
        batch=batch,
        context=context,
        backend=backend.name,
        ops=type(model.ops).__name__,
        roofline_ms=1000 * roof,
        gb_read=read / 1e9,
    )
    iters = 3 if ctx.quick else 10
    # eager first (its figure kept if the capture fails), then as the engine runs a decode
    # step on CUDA: the forward pass replayed from a graph; the ratio is of the engine's way
    for graph in [False, True] if ctx.cuda else [False]:
        label = "graphs" if graph else "eager"
        seconds = time_decode_step(model, backend, caches, step, ctx.sync, iters, graph=graph)
        f[f"step_ms_{label}"] = 1000 * seconds
        f["step_ms"] = 1000 * seconds
        f[f"ratio_{shape}_b{batch}_ctx{context}"] = seconds / roof
    del model, caches
    ctx.free()
    return True
