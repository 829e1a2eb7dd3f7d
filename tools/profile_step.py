"""Profile cbgen's engine steps: N requests of random prompt lengths, a fixed output length.

    python -m tools.profile_step --num 64 --prompt 88 --output 128 [--temperature 1] [--torch-profile | --cprofile]
    python -m tools.profile_step --alternate-head   # the exact LM head against the float32 one
    python -m tools.profile_step --alternate-decoder   # the forward pass in one C call or from Python
    python -m tools.profile_step --alternate-matmul 256   # small_gemm at every size, or oneDNN past 256 rows
    python -m tools.profile_step --alternate-blocked 1   # small_gemm's row blocks from the tuned size, or always

--torch-profile sees torch ops only; --cprofile also times the C kernels (called through ctypes),
per call site. Either profiles --profile-steps steps (10) after the first --profile-after steps;
a run that ends sooner profiles the steps it had. Without --model: SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time
from collections.abc import Callable

import torch

from cbgen.config import EngineConfig, SamplingParams
from cbgen.cpu.thresholds import build_small_gemm_blocked_rows
from cbgen.engine.engine import Engine
from cbgen.engine.outputs import StepStats
from cbgen.runtime.cpu import CpuRuntime


class Profiler:
    """One of torch's profiler or cProfile, started and stopped around a window of steps."""

    def __init__(self, kind: str, sort: str, rows: int) -> None:
        self.kind, self.sort, self.rows = kind, sort, rows
        self.torch_prof: torch.profiler.profile | None = None
        self.cprof: cProfile.Profile | None = None

    def start(self) -> None:
        if self.kind == "torch":
            self.torch_prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]
            )
            self.torch_prof.__enter__()
        else:
            self.cprof = cProfile.Profile()
            self.cprof.enable()

    def stop(self, steps: list[StepStats]) -> None:
        """Stop and print the profile of `steps`, the ones it saw."""
        seconds = sum(s.duration_s for s in steps)
        decodes = sum(s.num_decode_tokens for s in steps)
        print(f"profiled {len(steps)} steps ({decodes} decode tokens), {seconds:.3f} s:")
        if self.torch_prof is not None:
            self.torch_prof.__exit__(None, None, None)
            print(
                self.torch_prof.key_averages().table(
                    sort_by="self_cpu_time_total", row_limit=self.rows
                )
            )
        if self.cprof is not None:
            self.cprof.disable()
            pstats.Stats(self.cprof).sort_stats(self.sort).print_stats(self.rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num", type=int, default=64, help="requests, all added at the start")
    ap.add_argument(
        "--prompt", type=int, default=88, help="mean prompt length (uniform in [P/2, 3P/2])"
    )
    ap.add_argument(
        "--output", type=int, default=128, help="output tokens of every request (ignore_eos)"
    )
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--kv-cache-memory", type=int, default=2 << 30, help="bytes")
    ap.add_argument(
        "--num-threads", type=int, default=None, help="torch threads (default: every core)"
    )
    ap.add_argument("--torch-profile", action="store_true")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--profile-after", type=int, default=10, help="steps before the profiled ones")
    ap.add_argument("--profile-steps", type=int, default=10, help="steps profiled")
    ap.add_argument("--model", default=None)
    ap.add_argument(
        "--load-format", default="auto", help="dummy: random weights (any built-in shape)"
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy; > 0: seeded sampling (cbgen bench uses 1)",
    )
    ap.add_argument(
        "--sort", default="tottime", help="--cprofile: pstats sort key (tottime, cumtime, ...)"
    )
    ap.add_argument("--rows", type=int, default=15, help="profile rows to print")
    ap.add_argument(
        "--alternate-head",
        action="store_true",
        help="steps alternate between the model's exact LM head (bf16 or int16) and the float32 "
        "head, two at a time; prints the full decode steps' median of each",
    )
    ap.add_argument(
        "--alternate-decoder",
        action="store_true",
        help="steps alternate between the forward pass in one C call (cbgen.runtime.cpu_decoder) and the "
        "Python one, two at a time; prints the full decode steps' median of each",
    )
    ap.add_argument(
        "--alternate-matmul",
        type=int,
        metavar="ROWS",
        help="steps alternate between the matmuls' tuned split (small_gemm up to "
        "small_gemm_max_rows) and small_gemm up to ROWS rows, oneDNN past them, two at a time; "
        "prints both medians and the prompt steps' tokens/s of each",
    )
    ap.add_argument(
        "--alternate-blocked",
        type=int,
        metavar="ROWS",
        help="steps alternate between small_gemm's tuned switch to packed row blocks and the "
        "switch at ROWS rows, two at a time; prints both medians and the prompt steps' tokens/s",
    )
    args = ap.parse_args(argv)
    if args.torch_profile and args.cprofile:
        ap.error("choose one of --torch-profile and --cprofile")
    chosen = (
        args.alternate_head,
        args.alternate_decoder,
        args.alternate_matmul,
        args.alternate_blocked,
    )
    if sum(a not in (None, False) for a in chosen) > 1:
        ap.error("choose one of the --alternate-* options")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    engine = Engine(
        EngineConfig(
            model=args.model,
            load_format=args.load_format,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.budget,
            kv_cache_memory=args.kv_cache_memory,
            num_threads=args.num_threads,
        )
    )
    print(f"init {time.perf_counter() - t0:.1f}s threads={torch.get_num_threads()}")
    rng = random.Random(0)
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.output,
        ignore_eos=True,
        seed=1 if args.temperature else None,
    )
    vocab = engine.model_config.vocab_size
    low, high = min(100, vocab // 2), min(40000, vocab)  # ids clear of the special tokens
    for i in range(args.num):
        n = rng.randint(max(args.prompt // 2, 1), max(args.prompt * 3 // 2, 1))
        engine.add_request(str(i), [rng.randrange(low, high) for _ in range(n)], params)

    kind = "torch" if args.torch_profile else "cprofile" if args.cprofile else None
    profiler = Profiler(kind, args.sort, args.rows) if kind else None
    window = range(args.profile_after, args.profile_after + args.profile_steps)
    steps: list[StepStats] = []
    runtime = engine.runtime
    # (switch a path on or off, what the steps with it are called, what the others are)
    alternate: tuple[Callable[[bool], None], str, str] | None = None
    if args.alternate_head:
        if runtime.exact_head is None:
            raise SystemExit("--alternate-head: this model and CPU have no exact LM head")
        alternate = (
            switch(runtime, "exact_head"),
            type(runtime.exact_head).__name__,
            "float32 head",
        )
    if args.alternate_decoder:
        if not isinstance(runtime, CpuRuntime) or runtime.decoder is None:
            raise SystemExit("--alternate-decoder: this model and CPU have no native decoder")
        alternate = (switch(runtime, "decoder"), "one C call", "Python forward")
    if args.alternate_matmul is not None:
        if not isinstance(runtime, CpuRuntime):
            raise SystemExit("--alternate-matmul: not on the CPU")
        thresholds = runtime.thresholds

        def set_max_rows(rows: int) -> None:
            thresholds.small_gemm_max_rows = rows

        alternate = threshold(
            "--alternate-matmul",
            thresholds.small_gemm_max_rows,
            set_max_rows,
            args.alternate_matmul,
            "small_gemm up to {} rows",
        )
    if args.alternate_blocked is not None:
        if not isinstance(runtime, CpuRuntime):
            raise SystemExit("--alternate-blocked: not on the CPU")
        thresholds = runtime.thresholds

        def set_blocked(rows: int) -> None:
            thresholds.blocked_rows = rows

        alternate = threshold(
            "--alternate-blocked",
            thresholds.blocked_rows or build_small_gemm_blocked_rows(),
            set_blocked,
            args.alternate_blocked,
            "row blocks from {} rows",
        )
    with_it: list[bool] = []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        if profiler is not None and len(steps) == window.start:
            profiler.start()
        if alternate is not None:
            with_it.append(len(steps) // 2 % 2 == 0)
            alternate[0](with_it[-1])
        steps.append(engine.step().stats)
        if profiler is not None and len(steps) == window.stop:
            profiler.stop(steps[window.start :])
            profiler = None
    if profiler is not None and len(steps) > window.start:  # the run ended inside the window
        profiler.stop(steps[window.start :])
    wall = time.perf_counter() - t0

    prompt_tokens = sum(s.num_prefill_tokens for s in steps)
    out_tokens = args.num * args.output
    print(
        f"wall {wall:.2f}s steps {len(steps)} prompt {prompt_tokens} out {out_tokens} "
        f"total tok/s {(prompt_tokens + out_tokens) / wall:.1f} out tok/s {out_tokens / wall:.1f}"
    )
    full = sorted(
        s.duration_s
        for s in steps
        if s.num_prefill_tokens == 0 and s.num_decode_tokens == args.max_num_seqs
    )
    if full:
        print(f"full decode step median {1000 * full[len(full) // 2]:.1f} ms ({len(full)} steps)")
    if alternate is not None:
        for label, on in ((alternate[1], True), (alternate[2], False)):
            mine = [s for s, h in zip(steps, with_it, strict=True) if h is on]
            times = sorted(
                s.duration_s
                for s in mine
                if s.num_prefill_tokens == 0 and s.num_decode_tokens == args.max_num_seqs
            )
            if times:
                median = 1000 * times[len(times) // 2]
                print(f"  {label}: full decode step median {median:.1f} ms ({len(times)} steps)")
            prompt = [s for s in mine if s.num_prefill_tokens > 0]
            if prompt:
                tokens = sum(s.num_prefill_tokens + s.num_decode_tokens for s in prompt)
                seconds = sum(s.duration_s for s in prompt)
                print(
                    f"  {label}: steps with prompt tokens {tokens / seconds:.1f} tokens/s "
                    f"({len(prompt)} steps, {tokens} tokens)"
                )


def threshold(
    option: str, tuned: int, set_rows: Callable[[int], None], other: int, label: str
) -> tuple[Callable[[bool], None], str, str]:
    """An alternation between a kernel threshold's tuned value and `other` (0 tuned: no
    kernels here)."""
    if tuned == 0:
        raise SystemExit(f"{option}: no native kernels here")

    def set_it(on: bool) -> None:
        set_rows(tuned if on else other)

    return set_it, label.format(tuned), label.format(other)


def switch(holder: object, attribute: str) -> Callable[[bool], None]:
    """Sets holder.attribute to its present value (on) or None (off)."""
    value = getattr(holder, attribute)

    def set_it(on: bool) -> None:
        setattr(holder, attribute, value if on else None)

    return set_it


if __name__ == "__main__":
    main()
