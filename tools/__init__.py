"""Maintained measurement tools, run from the repository root as `python -m tools.<name>`:

    compare_peers   one workload through cbgen, transformers and vLLM's CPU build, one table
    profile_step    where an engine step's time goes (torch profiler or cProfile)
    gpu_check       the offline GPU check (sections in gpu_sections, models in gpu_fixtures)
    grammar_engines structured outputs: xgrammar, llguidance and outlines-core compared
    structured_bench the same ShareGPT rows with a JSON schema and without

The peer comparison starts its workers (cbgen_worker, hf_worker, vllm_worker) and the matmul
peak (matmul_peak) as `python -m tools.<name>` subprocesses; peer_common is what they share.
"""
