"""Peer worker: the workload through vLLM's CPU build (run with the vLLM venv's python).

vLLM pins its own torch, so it lives in a separate venv (docs/PERFORMANCE.md says how to
build it); compare_peers starts this module with that venv's interpreter, from a folder that
holds only a link to this package (see compare_peers.vllm_launch_dir). The environment
that matters is set by the caller before start-up (VLLM_CPU_OMP_THREADS_BIND, which cores
the OpenMP threads bind to; VLLM_CPU_KVCACHE_SPACE, the KV cache in GiB).

The body stays under `if __name__ == "__main__":` because vLLM starts its engine core in a
child process (spawn), which re-imports this module.
"""

from __future__ import annotations

import os
import tempfile
import time

from tools.peer_common import (
    PROCESS_START,
    Result,
    TimedWindow,
    check_lengths,
    fill_window,
    load_workload,
    peak_rss_gib,
    run_worker,
    worker_args,
)


def main() -> None:
    p = worker_args(__doc__.splitlines()[0])
    p.add_argument("--max-model-len", type=int, default=2048)
    args = p.parse_args()
    # vLLM inspects the model in a `python -m` subprocess, which puts the working directory
    # first on sys.path: from the repo root, the repo's own `kernels/` folder would shadow the
    # PyPI package `kernels` that vLLM and transformers probe. Run from elsewhere.
    for name in ("workload", "model", "out"):
        setattr(args, name, os.path.abspath(getattr(args, name)))
    os.chdir(tempfile.gettempdir())

    def body(result: Result) -> None:
        import vllm
        from vllm import LLM, SamplingParams

        items = load_workload(args.workload)
        llm = LLM(
            model=args.model,
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            enable_chunked_prefill=True,
            seed=0,
        )
        result.startup_s = time.perf_counter() - PROCESS_START
        prompts = [{"prompt_token_ids": it.prompt_token_ids} for it in items]
        params = [
            SamplingParams(temperature=0.0, max_tokens=it.output_len, ignore_eos=True)
            for it in items
        ]
        with TimedWindow() as w:
            outs = llm.generate(prompts, params, use_tqdm=False)
        fill_window(result, w)
        result.output_token_ids = [list(o.outputs[0].token_ids) for o in outs]
        check_lengths(result, items)
        result.prompt_tokens = sum(len(it.prompt_token_ids) for it in items)
        result.output_tokens = sum(it.output_len for it in items)
        result.peak_rss_gib = peak_rss_gib()  # while the engine-core child is alive
        result.detail = (
            f"vllm {vllm.__version__}, {args.dtype} ({llm.llm_engine.model_config.dtype}), "
            "chunked prefill, "
            f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND', '(unset)')}, "
            f"VLLM_CPU_KVCACHE_SPACE={os.environ.get('VLLM_CPU_KVCACHE_SPACE', '(unset)')} GiB, "
            f"LD_PRELOAD={preloaded_names(os.environ.get('LD_PRELOAD'))}"
        )
        # first_finished_s stays None: LLM.generate returns only when every request is done.
        engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None and callable(getattr(engine_core, "shutdown", None)):
            engine_core.shutdown(timeout=30)  # stop the engine-core and worker children

    run_worker("vLLM CPU", args.out, body)


def preloaded_names(ld_preload: str | None) -> str:
    """LD_PRELOAD's libraries by file name: the result files name no folder of the machine."""
    if not ld_preload:
        return "(unset)"
    return ":".join(os.path.basename(p) for p in ld_preload.split(":") if p)


if __name__ == "__main__":
    main()
