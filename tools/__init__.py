"""Maintained measurement tools, run from the repository root as `python -m tools.<name>`:

    compare_peers            one workload through cbgen, transformers, vLLM's CPU build and
                             llama.cpp
    gpu_check                the offline GPU check: its sections (gpu_correctness, gpu_speed)
                             share gpu_context; gpu_plan, the variants each compiles;
                             gpu_fixtures, the checkpoints and batches
    model_shapes             model shapes as config fields: the one registry of tiny models,
                             shared by the GPU check and the test suite (tests/helpers)
    attention_sweep          on a GPU: decode attention tiles and an 8B layer's matmuls, timed
    prefill_attention_bench  on the CPU: the C prefill attention against the decode kernel and
                             SDPA by chunk shape (where the build's prefill split comes from)
    object_store_bench       `cbgen run` on local files against the same run from and to a
                             bucket on a local S3 server (s3_server, which the tests use too)
    ray_bench                `cbgen run` against the same run under --ray with one engine, in
                             pairs; two engines' output against the plain run's
    sharegpt_rows            the peer comparison's ShareGPT workload as `cbgen run` rows
    gguf_models              random-weight 1B- and 8B-shaped GGUF files, quantized by llama.cpp
    quant_quality            a GGUF file's quantized path against its float path, beside
                             llama.cpp's logits on the same file
    llamacpp_worker          compare_peers' llama.cpp system (llama-cpp-python, extra llamacpp)
    mem_bandwidth            the read bandwidth that bounds one-sequence decode

Where a step's time goes, two kernel paths alternating in one run, and what structured outputs
cost are `cbgen bench` options (--profile, --alternate, --structured: docs/BENCH.md).

The peer comparison starts its workers (cbgen_worker, hf_worker, vllm_worker) and the matmul
peak (matmul_peak) as `python -m tools.<name>` subprocesses; peer_common is what they share.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"


def kernels_importable(children: bool = False) -> None:
    """Make cbgen and cbgen_kernels (kernels/cbgen_kernels, mapped by the package's install)
    importable from this checkout without an install, as on the GPU machine, where nothing is
    installed and the checkout is on PYTHONPATH. children: also put both on PYTHONPATH for the
    processes this one starts."""
    for folder in (str(ROOT), str(KERNELS)):
        if folder not in sys.path:
            sys.path.append(folder)
    if children:
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        paths += [f for f in (str(ROOT), str(KERNELS)) if f not in paths]
        os.environ["PYTHONPATH"] = os.pathsep.join(paths)


kernels_importable()
