"""Hub ids (org/name, org/name:file.gguf, --revision) resolved from a Hugging Face cache folder
made by the test: the local cache first, offline; the snapshot's commit reported; sharded
safetensors read through their index only. No network."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers.cli import cli_env, run, tiny, write_jsonl
from helpers.models import make_tiny_hf_model

from cbgen.engine.engine import Engine
from cbgen.models.hub import parse_hub_id
from cbgen.models.source import ModelNotFoundError, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_cache(root: Path, repo: str = "org/tiny", **save: object) -> Path:
    """A Hugging Face hub cache holding one snapshot of repo at COMMIT (refs/main)."""
    entry = root / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(COMMIT)
    tmp = root.parent / f"model-{repo.replace('/', '-')}"
    if not tmp.exists():
        make_tiny_hf_model("llama", tmp)
    for f in tmp.iterdir():
        shutil.copy(f, snapshot / f.name)
    return root


def test_hub_ids_are_told_from_paths_and_shapes() -> None:
    assert parse_hub_id("org/name") == ("org/name", None)
    assert parse_hub_id("Qwen/Qwen3-0.6B-GGUF:Qwen3-0.6B-Q8_0.gguf") == (
        "Qwen/Qwen3-0.6B-GGUF",
        "Qwen3-0.6B-Q8_0.gguf",
    )
    for not_hub in ("tiny-llama", "a/b/c", "/abs/path", "./rel/path", "org/name:notes.txt"):
        assert parse_hub_id(not_hub) is None, not_hub


def test_a_cached_snapshot_is_found_offline_with_its_commit(tmp_path: Path) -> None:
    cache = fake_cache(tmp_path / "hub")
    source = resolve_model("org/tiny", download_dir=str(cache))
    assert source.kind == "hf" and source.commit == COMMIT and source.name == "org/tiny"
    assert Path(source.path).name == COMMIT
    same = resolve_model("org/tiny", revision=COMMIT, download_dir=str(cache))
    assert same.path == source.path
    with pytest.raises(ModelNotFoundError) as missing:
        resolve_model("org/other", download_dir=str(cache))
    # what is wrong and how to allow a download, without huggingface_hub's advice to callers
    assert f"org/other is not in the local Hugging Face cache {cache} and" in str(missing.value)
    assert "downloads are off (HF_HUB_OFFLINE=1" in str(missing.value)
    assert str(missing.value).endswith("set HF_HUB_OFFLINE=0 to let cbgen download it")
    assert "local_files_only" not in str(missing.value)
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache"):
        resolve_model("org/tiny", revision="v2", download_dir=str(cache))
    with pytest.raises(ModelNotFoundError, match="revision: applies to a Hub id"):
        resolve_model(source.path, revision="main")
    # a GGUF repository with a file selector
    (Path(source.path) / "m.gguf").write_bytes(b"GGUF")
    gguf = resolve_model("org/tiny:m.gguf", download_dir=str(cache))
    assert gguf.kind == "gguf" and gguf.path.endswith("m.gguf") and gguf.commit == COMMIT


def test_sharded_weights_are_read_through_their_index(tmp_path: Path) -> None:
    """Only the shards the index names: a repository's other weight files are never read."""
    from transformers import AutoModelForCausalLM

    whole = make_tiny_hf_model("llama", tmp_path / "whole")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(whole).save_pretrained(sharded, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    (sharded / "consolidated.safetensors").write_bytes(b"not read")  # would fail if read

    def tokens(folder: Path) -> list[int]:
        engine = Engine(
            model=str(folder), device="cpu", dtype="float32", kv_cache_memory=4 << 20, num_threads=1
        )
        from cbgen.llm import LLM
        from cbgen.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        return LLM(engine=engine).generate([[5, 9, 17, 33]], params)[0].output_token_ids

    assert tokens(sharded) == tokens(whole)


def test_cbgen_run_takes_a_hub_id_from_hf_home(tmp_path: Path) -> None:
    home = tmp_path / "hf-home"
    fake_cache(home / "hub")
    src = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": [5, 9, 17]}])
    args = [a for a in tiny(Path("org/tiny")) if a not in ("--load-format", "dummy")]
    env = cli_env(HF_HOME=str(home), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    out = run(["run", str(src), *args], env=env)
    assert out.returncode == 0, out.stderr + out.stdout
    assert f"model org/tiny@{COMMIT[:12]}" in out.stdout
    summary = json.loads((tmp_path / "p.out.summary.json").read_text())
    assert summary["model_commit"] == COMMIT
    assert pq.read_table(tmp_path / "p.out.parquet").column("error").to_pylist() == [None]
    # HF_HUB_OFFLINE left unset: the command sets it, so a missing model is an error, not a
    # download, and the error says how to allow one
    env.pop("HF_HUB_OFFLINE")
    missing = run(
        [
            "run",
            str(src),
            *[a if a != "org/tiny" else "org/none" for a in args],
            "-o",
            str(tmp_path / "x.parquet"),
        ],
        env=env,
    )
    assert missing.returncode == 1, missing.stderr + missing.stdout
    assert "org/none is not in the local Hugging Face cache" in missing.stderr
    assert "set HF_HUB_OFFLINE=0 to let cbgen download it" in missing.stderr
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
