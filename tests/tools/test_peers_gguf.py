"""The peer comparison on a GGUF file: cbgen quantized, cbgen's float path and llama.cpp on the
same tiny random file, the exact-length workload kinds, and the llama.cpp worker's batches.
llama.cpp itself runs only where llama-cpp-python is installed (CI does not build it); without
it its row says why it was skipped."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tools import compare_peers, gguf_models
from tools.llamacpp_worker import Sequence, plan_batch
from tools.peer_common import WorkItem, tpot_extra

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("peers-gguf") / "tiny.Q8_0.gguf"
    gguf_models.write_gguf(path, gguf_models.builtin_shape("tiny-llama"), linear_type="Q8_0")
    return path


def test_a_batch_takes_every_decode_then_prompt_chunks_up_to_its_budget() -> None:
    a = Sequence(0, WorkItem("a", [5, 6, 7], 3), fed=3, out=[9])  # decoding
    b = Sequence(1, WorkItem("b", [1, 2, 3, 4], 2), fed=1)  # one prompt token in
    c = Sequence(2, WorkItem("c", [8, 8], 2))  # nothing in yet
    d = Sequence(3, WorkItem("d", [1], 1), fed=1, out=[4])  # done
    batch = plan_batch([a, b, c, d], n_batch=4)
    assert [(s.seq_id, tok, pos, logits) for s, tok, pos, logits in batch] == [
        (0, 9, 3, True),  # a's last token at its next position
        (1, 2, 1, False),
        (1, 3, 2, False),
        (1, 4, 3, True),  # b's prompt ends here: its first output is sampled
    ]
    assert [(s.seq_id, pos) for s, _, pos, _ in plan_batch([a, b, c, d], n_batch=3)] == [
        (0, 3), (1, 1), (1, 2),
    ]  # fmt: skip


def test_a_sequences_decode_speed_is_the_median_time_per_output_token() -> None:
    assert tpot_extra([0.1, None, 0.3, 0.2]) == {
        "tpot_median_s": 0.2,
        "decode_tokens_per_s_per_sequence": pytest.approx(5.0),
    }
    assert tpot_extra([None]) == {}


def test_compare_peers_runs_cbgen_both_ways_and_llama_cpp_on_one_gguf(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workload = tmp_path / "w.json"
    requests = [
        {"id": "a", "prompt_token_ids": [1, 520, 3000, 77, 9000, 12], "output_len": 4},
        {"id": "b", "prompt_token_ids": list(range(100, 130)), "output_len": 3},
    ]
    workload.write_text(json.dumps({"requests": requests}))
    compare_peers.main(
        [
            "--systems", "llama.cpp,cbgen,cbgen-float", "--gguf", str(tiny_gguf),
            "--model-dir", str(tmp_path / "no-folder"), "--workload", str(workload),
            "--max-num-seqs", "4", "--peak-seconds", "0.1", "--quiet-timeout", "0",
            "--worker-timeout", "300", "--keep", str(tmp_path / "out"),
        ]
    )  # fmt: skip
    runs = json.loads((tmp_path / "out" / "summary.json").read_text())["runs"]
    out = capsys.readouterr().out
    assert not (tmp_path / "no-folder").exists()  # neither the workload nor a system needed it
    for key in ("cbgen", "cbgen-float"):
        assert runs[key]["ok"], (key, runs[key].get("error"))
        assert runs[key]["output_tokens"] == 7
        assert runs[key]["extra"]["decode_tokens_per_s_per_sequence"] > 0
    assert "GGUF weights in their blocks (avx" in runs["cbgen"]["detail"]
    assert "GGUF weights in their blocks" not in runs["cbgen-float"]["detail"]
    assert "| cbgen, --dequantize (float path) |" in out
    llama = runs["llama.cpp"]
    if HAS_LLAMA_CPP:
        assert llama["ok"], llama.get("error")
        assert llama["output_tokens"] == 7 and "n_seq_max 2" in llama["detail"]
        assert "llama.cpp (llama-cpp-python), parallel sequences 2/2" in out
    else:
        assert not llama["ok"] and "llama_cpp" in llama["error"]
        assert "| llama.cpp (llama-cpp-python), parallel sequences | skipped:" in out


def test_the_exact_length_workload_kinds_give_every_request_its_length(tmp_path: Path) -> None:
    """one-sequence: one chat prompt and 128 new tokens, whatever ShareGPT's reply length."""
    from cbgen.models.source import resolve_model
    from cbgen.models.tokenizer import load_tokenizer

    folder = tmp_path / "tokenizer"
    load_tokenizer(resolve_model(None)).save_pretrained(folder)
    (folder / "config.json").write_text("{}")  # the workload reads the tokenizer alone
    compare_peers.main(
        [
            "--systems", "", "--workload-kind", "32-sequences", "--model-dir", str(folder),
            "--num-requests", "3", "--max-output-len", "6", "--peak-seconds", "0.1",
            "--quiet-timeout", "0", "--keep", str(tmp_path / "out"),
        ]
    )  # fmt: skip
    requests = json.loads((tmp_path / "out" / "workload.json").read_text())["requests"]
    assert [r["output_len"] for r in requests] == [6, 6, 6]
    assert compare_peers.WORKLOADS["one-sequence"] == (1, 0, 256, 128, True)
