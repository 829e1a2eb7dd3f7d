"""The measurement tools of `tools/` on tiny inputs: the peer comparison end to end on a tiny
random-weight model (ShareGPT sampling, the matmul peak, and each worker in its own process),
and the prefill-attention bench on two small chunks, so that a change to the engine's API or
the kernels' cannot leave them broken unnoticed."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO

from cbgen.cpu import build
from cbgen.engine.outputs import StepStats
from tools import compare_peers
from tools.cbgen_worker import attention_flops, flop_summary, keys_read
from tools.model_shapes import TINY_CHAT_LLAMA, hf_model


@pytest.fixture(scope="module")
def peer_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer llama with SmolLM2's vocabulary and tokenizer (chat template included), in
    random weights saved by transformers: the folder every peer reads."""
    from cbgen.models.source import resolve_model
    from cbgen.models.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp("tiny-peer-model")
    fields = {**TINY_CHAT_LLAMA, "max_position_embeddings": 512, "tie_word_embeddings": False}
    model = hf_model(fields, seed=0, pad_token_id=0)
    with torch.no_grad():  # large weights: logits far apart, so greedy is well defined
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.5 if "embed" in name or "lm_head" in name else 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    load_tokenizer(resolve_model(None)).save_pretrained(folder)
    return folder


def step(prefill: int, decode: int, scheduled: int, duration_s: float) -> StepStats:
    return StepStats(
        time=0.0, duration_s=duration_s, num_scheduled=scheduled, num_running=scheduled,
        num_waiting=0, num_kv_blocks_used=0, num_kv_blocks_total=1, num_preempted=0,
        total_preemptions=0, num_prefill_tokens=prefill, num_decode_tokens=decode, num_cached_tokens=0,
    )  # fmt: skip


def test_flop_summary_counts_full_batch_and_decode_only_steps() -> None:
    steps = [step(100, 4, 4, 1.0), step(0, 4, 4, 0.5), step(0, 4, 4, 0.25), step(0, 3, 3, 0.125)]
    s = flop_summary(steps, non_embedding_params=10, lm_head_params=5, max_num_seqs=4)
    assert (s["full_batch_tokens"], s["full_batch_steps_s"]) == (8, 0.75)
    assert (s["decode_tokens"], s["decode_steps_s"], s["num_decode_steps"]) == (11, 0.875, 3)
    assert s["full_batch_flops"] == 8 * 2 * (10 + 5)
    assert (s["computed_tokens"], s["flops_body"]) == (115, 115 * 2 * 10)


def test_attention_flops_count_each_positions_causal_keys_within_its_layers_window() -> None:
    # positions 0..4 read 1, 2, 3, 4, 5 keys; with a window of 3: 1, 2, 3, 3, 3
    assert (keys_read(5, None), keys_read(5, 3), keys_read(5, 5), keys_read(0, None)) == (
        15,
        12,
        15,
        0,
    )
    for n in range(12):
        for w in (None, 1, 4, 20):
            assert keys_read(n, w) == sum(min(p + 1, w or p + 1) for p in range(n))
    # a request of 3 prompt + 2 output tokens runs 4 positions: 10 keys in a full layer, 1 + 2
    # + 2 + 2 in a layer with a window of 2; 4 x heads x head_dim FLOPs a key
    assert attention_flops([(3, 2)], [None, 2], num_heads=2, head_dim=4) == 4 * 2 * 4 * (10 + 7)
    two = attention_flops([(3, 2), (1, 1)], [None], num_heads=1, head_dim=1)
    assert two == 4 * (10 + 1)  # a one-token prompt with one output token: one position


def test_peer_model_folder_is_converted_again_when_made_from_another_gguf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The converted folder records its GGUF: a run on another file must not read this one's
    weights (a 1B file's folder once fed vLLM in a SmolLM2 run), a user's own folder is left."""
    converted: list[str] = []

    def fake_convert(cmd: list[str], **_: object) -> None:  # hf_worker convert GGUF OUT
        gguf, out = Path(cmd[-2]), Path(cmd[-1])
        out.mkdir()
        (out / "config.json").write_text(json.dumps({"from": gguf.name}))
        converted.append(gguf.name)

    monkeypatch.setattr(compare_peers.subprocess, "run", fake_convert)
    small, big = tmp_path / "small.gguf", tmp_path / "big.gguf"
    small.write_bytes(b"1" * 10)
    big.write_bytes(b"2" * 20)
    folder = tmp_path / "peers" / "model-f32"

    def made_from() -> str:
        return json.loads((folder / "config.json").read_text())["from"]

    compare_peers.ensure_model_dir(small, folder, {})
    compare_peers.ensure_model_dir(small, folder, {})  # the same file: kept
    assert converted == ["small.gguf"] and made_from() == "small.gguf"
    compare_peers.ensure_model_dir(big, folder, {})
    assert converted == ["small.gguf", "big.gguf"] and made_from() == "big.gguf"
    small.write_bytes(b"1" * 11)  # the same name, another file
    compare_peers.ensure_model_dir(small, folder, {})
    assert converted[-1] == "small.gguf" and made_from() == "small.gguf"
    (folder / compare_peers.SOURCE_RECORD).unlink()  # a folder the user made
    compare_peers.ensure_model_dir(big, folder, {})
    assert len(converted) == 3 and made_from() == "small.gguf"
    assert compare_peers.default_model_dir(small) != compare_peers.default_model_dir(big)


def run_compare_peers(tmp_path: Path, model_dir: Path, systems: str, *extra: str) -> dict:
    compare_peers.main(
        [
            "--systems", systems, "--model-dir", str(model_dir), "--cbgen-model", str(model_dir),
            "--num-requests", "3", "--max-prompt-len", "48", "--max-output-len", "5",
            "--max-num-seqs", "4", "--static-batch-size", "2", "--peak-seconds", "0.1",
            "--quiet-timeout", "0", "--worker-timeout", "300", "--keep", str(tmp_path), *extra,
        ]
    )  # fmt: skip
    return json.loads((tmp_path / "summary.json").read_text())


def test_compare_peers_runs_cbgen_and_both_transformers_modes_on_sharegpt(
    peer_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = run_compare_peers(tmp_path, peer_model_dir, "cbgen,hf-static,hf-cb,vllm")
    out = capsys.readouterr().out
    w = summary["workload"]
    assert w["requests"] == 3 and 0 < w["output_tokens"] <= 15 and w["prompt_tokens"] > 3 * 20
    runs = summary["runs"]
    for key in ("cbgen", "hf-static", "hf-cb"):
        assert runs[key]["ok"], (
            key,
            runs[key].get("error"),
            (tmp_path / f"{key}.log").read_text()[-3000:],
        )
        assert (runs[key]["prompt_tokens"], runs[key]["output_tokens"]) == (
            w["prompt_tokens"],
            w["output_tokens"],
        )
    assert runs["vllm"] == {"ok": False, "error": "no --vllm-python given"}
    assert "| vLLM CPU build, float32 | skipped: no --vllm-python given |" in out
    # Every prompt token is computed or comes from the prefix cache (the chat template's system
    # prompt); each request's first output token comes with its prompt, the others decode.
    cb = runs["cbgen"]["extra"]
    assert cb["cached_tokens"] > 0
    assert (
        cb["computed_tokens"] + cb["cached_tokens"] == w["prompt_tokens"] + w["output_tokens"] - 3
    )
    peak = summary["peak"]
    assert peak["gflops"] == max(peak["gflops_before"], peak["gflops_after"]) > 0
    # The ceiling counts the workload's attention beside its matmuls, from the requests' lengths
    # and the model's shape; the matmuls' ceiling alone is kept too
    requests = json.loads((tmp_path / "workload.json").read_text())["requests"]
    positions = [len(r["prompt_token_ids"]) + r["output_len"] - 1 for r in requests]
    c = TINY_CHAT_LLAMA
    layers, heads = c["num_hidden_layers"], c["num_attention_heads"]
    head_dim = c["hidden_size"] // heads
    attn = layers * 4 * heads * head_dim * sum(n * (n + 1) // 2 for n in positions) / 1e9
    assert w["gflop_attention"] == pytest.approx(attn) and attn > 0
    assert w["ceiling_tokens_per_s"] == pytest.approx(
        w["ceiling_tokens_per_s_matmuls"] * w["gflop"] / (w["gflop"] + attn)
    )
    assert "of attention (q.k and p x v over each position's causal keys)" in out
    # Same weights, greedy, fp32: every system produces cbgen's tokens.
    assert "transformers generate, static B=2 3/3" in out
    assert "transformers continuous batching (sdpa, paged) 3/3" in out


def test_compare_peers_runs_cbgen_in_the_dtype_asked_for(
    peer_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--dtype bfloat16: cbgen's worker runs its bf16 path (its start-up line says so), and
    vLLM is asked for the same dtype as well as for its own default (vllm-default)."""
    summary = run_compare_peers(
        tmp_path, peer_model_dir, "cbgen,vllm,vllm-default", "--dtype", "bfloat16",
        "--workload-kind", "32-sequences",
    )  # fmt: skip
    # the kind is stored in workload.json and read back from it (as when --workload reuses it)
    assert summary["workload"]["kind"] == "32-sequences"
    assert json.loads((tmp_path / "workload.json").read_text())["kind"] == "32-sequences"
    runs = summary["runs"]
    assert runs["cbgen"]["ok"] and " on cpu bfloat16 (" in runs["cbgen"]["detail"]
    out = capsys.readouterr().out
    assert "| vLLM CPU build, bfloat16 | skipped: no --vllm-python given |" in out
    assert "| vLLM CPU build, its default dtype | skipped: no --vllm-python given |" in out
    assert ", bfloat16, greedy" in out


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_compare_peers_runs_vllm(
    peer_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = run_compare_peers(
        tmp_path, peer_model_dir, "cbgen,vllm", "--vllm-python", sys.executable
    )
    vllm = summary["runs"]["vllm"]
    assert vllm["ok"], (vllm.get("error"), (tmp_path / "vllm.log").read_text()[-3000:])
    assert vllm["output_tokens"] == summary["workload"]["output_tokens"]
    assert "vLLM CPU build, float32 3/3" in capsys.readouterr().out


def test_share_of_peak_is_the_workloads_matmul_work_at_the_peak() -> None:
    w = {"requests": 2, "prompt_tokens": 1000, "output_tokens": 200, "longest_prompt": 600}
    # cbgen computed fewer tokens than the workload has (prefix cache hits): the work it
    # needs is counted from the workload, the parameter counts from cbgen's run
    extra = flop_summary(
        [step(700, 0, 2, 1.0)], non_embedding_params=10, lm_head_params=5, max_num_seqs=2
    )
    gflop = compare_peers.workload_gflop(w, extra)
    assert gflop is not None and gflop == pytest.approx((1200 * 2 * 10 + 200 * 2 * 5) / 1e9)
    ceiling = compare_peers.ceiling_tokens_per_s(w, gflop, peak_gflops=1e-3)
    assert ceiling == pytest.approx(1200 * 1e-3 / gflop)
    assert compare_peers.workload_gflop(w, {}) is None  # no cbgen run, no parameter counts
    assert compare_peers.attention_gflop({"flops_attention": 3e9}) == 3.0
    assert compare_peers.attention_gflop(extra) == 0.0  # a run that did not count it
    res = {
        "ok": True, "prompt_tokens": 1000, "output_tokens": 200, "elapsed_s": 1200 / (ceiling / 4),
        "startup_s": 1.0, "peak_rss_gib": 1.0, "other_cores": 0.0,
    }  # fmt: skip
    table = compare_peers.fmt_table(
        [compare_peers.Run("cbgen", res, 0.0)], {"cbgen": "cbgen"}, ceiling
    )
    assert "| share of fp32 peak |" in table and "| 1.00x | 25% |" in table


def test_the_prompt_heavy_workload_keeps_only_long_prompts(
    peer_model_dir: Path, tmp_path: Path
) -> None:
    import argparse

    args = argparse.Namespace(
        num_requests=2,
        seed=0,
        min_prompt_len=300,
        max_prompt_len=400,
        max_output_len=3,
        exact_output_len=False,
    )
    w = compare_peers.build_workload(peer_model_dir, args, tmp_path / "workload.json")
    assert w["requests"] == 2 and w["output_tokens"] <= 6
    for r in json.loads((tmp_path / "workload.json").read_text())["requests"]:
        # 300-400 raw tokens, plus the chat template's system prompt and turn markers
        assert 300 < len(r["prompt_token_ids"]) <= 400 + 60


def test_the_vllm_worker_names_preloaded_libraries_without_their_folders() -> None:
    from tools.vllm_worker import preloaded_names

    assert preloaded_names(None) == "(unset)"
    assert preloaded_names("") == "(unset)"
    assert (
        preloaded_names("libtcmalloc_minimal.so.4:/opt/venv/lib/libiomp5.so")
        == "libtcmalloc_minimal.so.4:libiomp5.so"
    )


def test_the_peak_is_the_higher_of_the_measurements_before_and_after_the_runs() -> None:
    before = {"gflops": 124.3, "n": 2048.0, "threads": 2.0, "reps": 9.0}
    after = {"gflops": 139.5, "n": 2048.0, "threads": 2.0, "reps": 11.0}
    for a, b in ((before, after), (after, before)):
        best = compare_peers.best_peak(a, b)
        assert best["gflops"] == 139.5 and best["reps"] == 11.0
        assert (best["gflops_before"], best["gflops_after"]) == (a["gflops"], b["gflops"])


@pytest.mark.skipif(build.load_library() is None, reason=build.native_status())
def test_the_prefill_attention_bench_times_each_chunk_three_ways() -> None:
    """Run as it is run (its own process: it sets OMP_NUM_THREADS before the kernels load)."""
    result = subprocess.run(
        [sys.executable, "-m", "tools.prefill_attention_bench", "--reps", "2",
         "--shapes", "4x0,2x16", "--heads", "2", "--kv-heads", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if re.match(r"\| \d+[, ]", line)]
    # rows read: 4 query tokens read 1..4 keys (10); 2 after 16 cached read 17 and 18 (35)
    assert [r.split("|")[1:3] for r in rows] == [
        [" 4, no context ", " 10 "],
        [" 2 after 16 ", " 35 "],
    ]
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")[2:]]
        assert len(cells) == 5 and all(float(c) > 0 for c in cells), r
