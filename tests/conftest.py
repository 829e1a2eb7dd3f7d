"""Shared fixtures, visible to every test folder: the real SmolLM2 (loaded once per session),
tiny random-weight models written by transformers itself (so cbgen and transformers read the
very same weights), the `cbgen run` tests' chat model, the CPU kernels' AVX2 build and a local
Ray cluster. What the tests share besides fixtures is in tests/helpers."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# cbgen_kernels lives in kernels/, which the package's install maps; without an install (the
# GPU machine runs this suite from a bare checkout) the folder itself goes on the path
_KERNELS = str(Path(__file__).resolve().parent.parent / "kernels")
if _KERNELS not in sys.path:
    sys.path.append(_KERNELS)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CBGEN_CPU_TUNING", "off")  # the build defaults: no timing decides a path

import torch  # noqa: E402 - after the environment above

torch.set_num_threads(1)  # two xdist workers on two cores
if not torch.cuda.is_available():
    # Triton kernels run in the interpreter on the CPU; it must be chosen before triton loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        from helpers.models import make_tiny_hf_model

        if kind not in cache:
            cache[kind] = make_tiny_hf_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))
        return cache[kind]

    return get


@pytest.fixture(scope="module")
def model_dir(
    tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny Llama with the character tokenizer (helpers.models.write_char_tokenizer)."""
    from helpers.models import write_char_tokenizer

    folder = tmp_path_factory.mktemp("tiny-llama-chars")
    shutil.copytree(tiny_model_dir("llama"), folder, dirs_exist_ok=True)
    write_char_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dummy-weight config.json (tools.model_shapes.TINY_CHAT_LLAMA) beside SmolLM2's
    tokenizer files, for `cbgen run`; built by the first xdist worker that gets here and renamed
    into place atomically, reused by the others."""
    from cbgen.models.source import resolve_model
    from cbgen.models.tokenizer import load_tokenizer
    from tools.model_shapes import TINY_CHAT_LLAMA

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    final = root / "cbgen-run-tiny-chat"
    if (final / "config.json").exists():
        return final
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tiny-chat-"))
    load_tokenizer(resolve_model(None)).save_pretrained(tmp)
    (tmp / "config.json").write_text(json.dumps(TINY_CHAT_LLAMA))
    try:
        os.rename(tmp, final)
    except OSError:  # another worker got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return final


AVX2_FLAGS = ("-mno-avx512f",)


@pytest.fixture(scope="session")
def avx2_build(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The CPU kernels compiled with AVX-512 switched off (what an AVX2-only CPU gets), into a
    fresh folder, once per test session."""
    import platform

    from cbgen.cpu import build as cpu_build

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("-mno-avx512f is an x86 flag")
    build = cpu_build.build_library(tmp_path_factory.mktemp("kernels-avx2"), AVX2_FLAGS)
    assert build.library is not None, build.status()
    cc = cpu_build.find_compiler()
    assert cc is not None
    target = cpu_build.probe_target(cc, (*cpu_build._FLAGS, *AVX2_FLAGS))
    assert "__AVX512F__" not in target.macros and "__AVX2__" in target.macros, build.reason
    return build


@pytest.fixture(params=["native", "avx2"])
def each_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A kernel test runs against the default build and against the AVX2 one."""
    from cbgen.cpu import build as cpu_build

    if request.param == "avx2":
        lib = request.getfixturevalue("avx2_build").library
        monkeypatch.setattr(cpu_build, "load_library", lambda extra_flags=(): lib)
    return str(request.param)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from cbgen.models.source import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_engine() -> Any:
    """The real model in cbgen, loaded once per test session (float32, CPU), its GGUF file
    dequantized: the path that is token-exact against transformers."""
    from cbgen.engine.engine import Engine

    return Engine(
        max_num_seqs=16,
        kv_cache_memory=256 << 20,
        device="cpu",
        dtype="float32",
        num_threads=1,
        dequantize=True,
    )


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path: str) -> Any:
    """The same weights in transformers (GGUF dequantized by transformers itself)."""
    from transformers import AutoModelForCausalLM

    p = Path(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(
        str(p.parent), gguf_file=p.name, dtype=torch.float32
    )
    model.eval()
    return model


@pytest.fixture(scope="session")
def ray_cluster() -> Any:
    """A local Ray cluster of 2 CPUs, started once per test session in this process (the Ray
    tests share one xdist group, so one worker starts it); its GCS address lets a `cbgen run
    --ray ADDRESS` subprocess join it. Skips where Ray is not installed."""
    import logging

    ray = pytest.importorskip("ray")
    context = ray.init(
        address="local",  # a cluster of its own, not one `ray start` left running here
        num_cpus=2,
        include_dashboard=False,
        logging_level=logging.ERROR,
        log_to_driver=False,
        object_store_memory=128 << 20,
    )
    yield context.address_info["gcs_address"]
    ray.shutdown()
