"""The Python half of scripts/gpu_check.sh: each subcommand prints plain-text results (the
shell script appends them to one results file).

    python scripts/gpu_check.py env       versions, GPU, which attention backends can run
    python scripts/gpu_check.py greedy    SmolLM2 greedy tokens: triton / flash / torch
                                          backends against transformers, fp32 and bf16
    python scripts/gpu_check.py bench     llama-1b (dummy weights) throughput per backend,
                                          and long-context decodes with and without split-KV
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from cbgen.attention.flash_backend import flash_available
from cbgen.attention.triton_backend import triton_available
from cbgen.config import EngineConfig, SamplingParams
from cbgen.engine.engine import Engine

GiB = 1 << 30

PROMPTS: list[Any] = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    [{"role": "user", "content": "What is continuous batching in LLM inference?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who had never once left the valley. Every morning he",
    [{"role": "user", "content": "Explain why the sky is blue to a ten year old, in detail."}],
    "1, 2, 3, 4, 5,",
    [{"role": "user", "content": "List three prime numbers larger than 100."}],
]
NEW_TOKENS = 32
DEVICE = "cuda"
"""--device cpu (with TRITON_INTERPRET=1 and a tiny --model) only to smoke-test this script."""


def backends() -> list[str]:
    names = ["torch"]
    if triton_available() and (DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        names.append("triton")
    if flash_available() and DEVICE == "cuda":
        names.append("flash")
    return names


def free_cuda() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ---- env ------------------------------------------------------------------------------------


def cmd_env() -> int:
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}")
    if not torch.cuda.is_available():
        print("CUDA: not available")
        return 1
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {p.name}, {p.total_memory / GiB:.1f} GiB, {p.multi_processor_count} SMs, sm_{p.major}{p.minor}")
    try:
        import triton

        print(f"triton {triton.__version__}")
    except ImportError:
        print("triton: not installed")
    print(f"vllm_flash_attn: {flash_available() or 'not importable'}")
    print(f"backends that can run: {', '.join(backends())}")
    return 0


# ---- greedy ---------------------------------------------------------------------------------


def hf_greedy(model: Any, prompt_ids: list[int], n: int) -> list[int]:
    from transformers import GenerationConfig

    x = torch.tensor([prompt_ids], device=DEVICE)
    model.generation_config.eos_token_id = None
    gc_ = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=[], pad_token_id=0)
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gc_)
    return out[0, x.shape[1]:].tolist()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def compare(label: str, got: list[list[int]], want: list[list[int]]) -> bool:
    same = sum(g == w for g, w in zip(got, want, strict=True))
    prefix = sum(common_prefix(g, w) for g, w in zip(got, want, strict=True)) / len(want)
    ok = same == len(want)
    print(f"  {label}: {same}/{len(want)} prompts identical, mean common prefix {prefix:.1f}/{NEW_TOKENS} tokens")
    return ok


def cmd_greedy() -> int:
    from transformers import AutoModelForCausalLM

    from cbgen.llm import LLM
    from cbgen.models.loader import default_model_path

    path = Path(default_model_path())
    failures = 0
    # Dequantized once in float32, cast to bfloat16 for the second pass (as cbgen's loader does).
    hf: Any = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    hf = hf.to(DEVICE).eval()
    for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        t0 = time.perf_counter()
        opts: dict[str, Any] = dict(device=DEVICE, dtype=dtype_name, attention_backend="torch",
                                    kv_cache_memory=1 * GiB, max_model_len=2048)
        base = Engine(EngineConfig(**opts))
        prompts = [base.apply_chat_template(p) if isinstance(p, list) else base.tokenize(p) for p in PROMPTS]
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        results: dict[str, list[list[int]]] = {}
        for name in backends():
            if name == "flash" and dtype == torch.float32:
                continue
            engine = base if name == "torch" else Engine(base.config.replace(attention_backend=name),
                                                         share_weights_with=base)
            outs = LLM(engine=engine).generate(prompts, params)
            results[name] = [o.output_token_ids for o in outs]
            if engine is not base:
                del engine
                free_cuda()
        hf = hf.to(dtype)
        results["hf"] = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
        del base
        free_cuda()
        print(f"SmolLM2-135M-Instruct, {dtype_name}, {len(prompts)} prompts x {NEW_TOKENS} greedy tokens "
              f"({time.perf_counter() - t0:.0f} s):")
        for name in results:
            if name == "hf":
                continue
            ok_hf = compare(f"{name:6s} vs transformers", results[name], results["hf"])
            ok_torch = name == "torch" or compare(f"{name:6s} vs torch backend", results[name], results["torch"])
            if dtype == torch.float32 and not (ok_hf and ok_torch):
                failures += 1
        if dtype == torch.bfloat16:
            print("  (bf16: rounding differs between implementations, so greedy paths may part after a "
                  "near-tie; reported, not judged)")
    print(f"greedy: {'PASS' if failures == 0 else f'FAIL ({failures} fp32 mismatches)'}")
    return 1 if failures else 0


# ---- bench ----------------------------------------------------------------------------------


def run_workload(engine: Engine, prompts: list[list[int]], out_len: int) -> dict[str, float]:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    run = f"run{time.monotonic_ns()}"
    for i in range(4):  # warm-up: kernels compile, allocator settles
        engine.add_request(f"{run}-warm-{i}", prompts[i][:64], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    sync()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{run}-{i}", p, params)
    steps, decode_steps, decode_s = 0, 0, 0.0
    outputs = 0
    while engine.has_unfinished_requests():
        out = engine.step()
        steps += 1
        outputs += sum(o.num_output_tokens for o in out.finished)
        if out.stats.num_prefill_tokens == 0:
            decode_steps += 1
            decode_s += out.stats.duration_s
    sync()
    wall = time.perf_counter() - t0
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "wall_s": wall,
        "output_tok_s": outputs / wall,
        "total_tok_s": (outputs + prompt_tokens) / wall,
        "steps": steps,
        "decode_step_ms": 1000 * decode_s / max(1, decode_steps),
        "preemptions": engine.total_preemptions,
    }


def random_prompts(n: int, mean_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(vocab // 100, vocab - vocab // 100) for _ in range(rng.randint(mean_len // 2, mean_len * 3 // 2))]
        for _ in range(n)
    ]


def cmd_bench(model: str, num_prompts: int, input_len: int, output_len: int, long_len: int, long_out: int) -> int:
    from cbgen.attention.triton_backend import TritonAttentionBackend

    names = [b for b in backends() if b != "torch"] if DEVICE == "cuda" else backends()
    print(f"{model} (dummy weights), {num_prompts} requests, prompts ~{input_len} "
          f"(uniform +-50%), {output_len} output tokens each, ignore_eos, max_num_seqs 256:")
    for name in names:
        opts: dict[str, Any] = dict(model=model, load_format="dummy", device=DEVICE, attention_backend=name,
                                    max_num_seqs=256, max_model_len=long_len + long_out + 68,
                                    kv_cache_memory=None if DEVICE == "cuda" else 64 << 20)
        engine = Engine(EngineConfig(**opts))
        print(f"  start-up: {engine.describe()} (init {engine.init_time_s:.1f} s)")
        prompts = random_prompts(num_prompts, input_len, engine.model_config.vocab_size)
        r = run_workload(engine, prompts, output_len)
        print(f"  {name:6s}: {r['output_tok_s']:8.0f} output tok/s, {r['total_tok_s']:8.0f} total tok/s, "
              f"{r['wall_s']:.1f} s, {r['steps']} steps, decode step {r['decode_step_ms']:.2f} ms, "
              f"{r['preemptions']} preemptions")
        if name == "triton":
            # Few long sequences: the case split-KV (flash-decoding) exists for.
            long_prompts = random_prompts(4, 2 * long_len, engine.model_config.vocab_size, seed=1)
            long_prompts = [p[:long_len] for p in long_prompts]
            for label, max_splits in (("split-KV", 16), ("no split", 1)):
                backend = TritonAttentionBackend(max_splits=max_splits)
                engine.backend = engine.runner.backend = backend
                r = run_workload(engine, long_prompts, long_out)
                print(f"  triton, 4 requests x {long_len}-token prompts, {long_out} outputs, {label}: "
                      f"decode step {r['decode_step_ms']:.2f} ms, {r['output_tok_s']:.0f} output tok/s")
        del engine
        free_cuda()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["env", "greedy", "bench"])
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--long-len", type=int, default=3900, help="bench: prompt length of the split-KV case")
    ap.add_argument("--long-out", type=int, default=128, help="bench: output length of the split-KV case")
    ap.add_argument("--model", default="llama-1b", help="bench: built-in shape")
    ap.add_argument("--device", default="cuda", help="cpu: smoke-test this script only")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.what == "env":
        return cmd_env()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    if args.what == "greedy":
        return cmd_greedy()
    return cmd_bench(args.model, args.num_prompts, args.input_len, args.output_len, args.long_len, args.long_out)


if __name__ == "__main__":
    sys.exit(main())
