"""tools/quant_quality.py: the distance metrics on known inputs, the teacher-forced logits read
from the engine's prompt scoring (aligned with the logprobs the engine hands out), and one
file measured end to end on a tiny random GGUF; llama.cpp's rows only where llama-cpp-python
is installed (CI does not build it)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from cbgen.engine.engine import Engine
from cbgen.sampling_params import SamplingParams
from tools import gguf_models, quant_quality

PROMPTS = [[1, 520, 3000, 77, 9000, 12, 5, 600], list(range(100, 140)), [2, 3]]


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("quant-quality") / "tiny.Q4_0.gguf"
    gguf_models.write_gguf(path, gguf_models.builtin_shape("tiny-llama"), linear_type="Q4_0")
    return path


def test_kl_divergence_and_top1_on_known_distributions() -> None:
    ref = torch.tensor([[0.0, math.log(3.0)], [5.0, 1.0]])
    other = torch.tensor([[0.0, 0.0], [2.0, 7.0]])
    kl = quant_quality.kl_divergence(ref, other)
    # p = (1/4, 3/4) against q = (1/2, 1/2)
    assert kl[0].item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5))
    assert kl[1].item() > 0
    a = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    b = torch.tensor([[0.5, 2.5, 2.4], [0.0, 0.0, 1.0]])
    assert quant_quality.top1_agreement(a, b).tolist() == [True, False]
    # a constant added to every logit is the same distribution
    same = quant_quality.kl_divergence(ref, ref + 4.0)
    assert same.abs().max().item() < 1e-12


def test_distance_summarises_every_position() -> None:
    d = quant_quality.Distance()
    ref = torch.randn(300, 11, generator=torch.Generator().manual_seed(0))
    d.add(ref, ref.clone())
    d.add(ref[:5], ref[:5].flip(-1))
    s = d.summary()
    assert s["positions"] == 305 and s["kl_max"] > 0 and s["kl_median"] == 0.0
    flipped = (ref[:5].argmax(-1) == ref[:5].flip(-1).argmax(-1)).sum().item()
    assert s["top1_agreement"] == pytest.approx((300 + flipped) / 305)
    with pytest.raises(ValueError):
        d.add(ref, ref[:, :3])


def test_the_recorded_logits_are_the_ones_the_engines_prompt_logprobs_come_from(
    tiny_q4: Path,
) -> None:
    """Position p's recorded logits score prompt token p + 1: their log-softmax at that token is
    the logprob the engine reports for it, so rows and positions line up."""
    engine = Engine(model=str(tiny_q4), max_num_seqs=1, kv_cache_memory=1 << 26)
    logits = list(quant_quality.cbgen_prompt_logits(engine, PROMPTS))
    assert [x.shape for x in logits] == [(len(p) - 1, 49152) for p in PROMPTS]
    assert "compute_logits" not in vars(engine.model)  # the wrapper is gone
    ids = PROMPTS[1]
    engine.add_request("check", ids, SamplingParams(max_tokens=1, prompt_logprobs=0))
    done = []
    while engine.has_unfinished_requests():
        done += engine.step().finished
    reported = [p.logprob for p in done[0].prompt_logprobs[1:]]
    mine = torch.log_softmax(logits[1].double(), -1)[torch.arange(len(ids) - 1), ids[1:]]
    assert mine.tolist() == pytest.approx(reported, abs=1e-4)


def test_a_file_is_measured_against_its_own_float_path(tiny_q4: Path) -> None:
    res = quant_quality.measure_file(
        tiny_q4, PROMPTS, llama_cpp=False, threads=1, log=lambda _: None
    )
    q = res["cbgen_quantized"]
    assert q["positions"] == sum(len(p) - 1 for p in PROMPTS)
    assert 0.5 < q["top1_agreement"] <= 1.0 and 0 <= q["kl_mean"] < 1e-3
    assert res["types"] == {"Q4_0": 16, "F32": 5} and "llama_cpp" not in res
    assert "Q4_0 x16" in res["cbgen_quantized_start_up"]
    table = quant_quality.fmt_table([res])
    assert "| tiny.Q4_0.gguf | Q4_0 16, F32 5 | 47 | cbgen quantized |" in table
    assert quant_quality.verdict(res) is None


@pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (the llamacpp extra; CI does not build it)",
)
def test_llama_cpps_logits_are_measured_the_same_way(tiny_q4: Path) -> None:
    res = quant_quality.measure_file(
        tiny_q4, PROMPTS, llama_cpp=True, threads=1, log=lambda _: None
    )
    for key in ("llama_cpp", "cbgen_quantized_vs_llama_cpp"):
        s = res[key]
        assert s["positions"] == 47 and 0.5 < s["top1_agreement"] <= 1.0 and s["kl_mean"] < 1e-3
    assert "llama.cpp's" in (quant_quality.verdict(res) or "")
