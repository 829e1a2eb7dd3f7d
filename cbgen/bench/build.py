"""Turn the workload options into requests for one loaded model (its tokenizer, vocabulary and
length limit)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cbgen.bench.sharegpt import DEFAULT_MAX_TOTAL_LEN, sample_sharegpt
from cbgen.bench.workloads import (
    BenchRequest,
    Encode,
    file_workload,
    fold_into_vocab,
    prefix_workload,
    random_workload,
)
from cbgen.engine.engine import Engine


def _encoder(engine: Engine, chat_template: bool | None) -> tuple[Encode, bool]:
    """Text (or chat messages) -> token ids, and whether text goes through the chat template
    (by default when the model has one)."""
    if engine.tokenizer is None:

        def no_tokenizer(_: Any) -> list[int]:
            raise ValueError("this model has no tokenizer: give prompts as token ids")

        return no_tokenizer, False
    has_template = bool(getattr(engine.tokenizer, "chat_template", None))
    use_template = has_template if chat_template is None else chat_template
    if use_template and not has_template:
        raise ValueError("chat_template: this model has no chat template")

    def encode(prompt: Any) -> list[int]:
        if isinstance(prompt, list):
            return engine.apply_chat_template(prompt)
        if use_template:
            return engine.apply_chat_template([{"role": "user", "content": prompt}])
        return engine.tokenize(prompt)

    return encode, use_template


def build_workload(
    engine: Engine, name: str, o: dict[str, Any]
) -> tuple[list[BenchRequest], dict[str, Any]]:
    """The requests and a description of how they were made."""
    vocab = engine.model_config.vocab_size
    info: dict[str, Any] = {
        "name": name,
        "num_prompts": o["num_prompts"],
        "seed": o["seed"],
        "request_rate": o.get("request_rate"),
    }
    encode, use_template = _encoder(engine, o.get("chat_template"))
    if name in ("sharegpt", "file"):
        info["chat_template"] = use_template
    if name == "sharegpt":
        tok = engine.tokenizer
        if tok is None:
            raise ValueError(
                "workload sharegpt: this model has no tokenizer (try --workload random)"
            )
        max_total = min(DEFAULT_MAX_TOTAL_LEN, engine.max_model_len)
        requests = sample_sharegpt(
            encode,
            lambda text: len(tok(text, add_special_tokens=False)["input_ids"]),
            o["num_prompts"],
            o["seed"],
            max_prompt_len=min(o["max_prompt_len"], engine.max_prompt_len),
            max_output_len=o.get("max_output_len"),
            max_total_len=max_total,
            path=o.get("dataset_path"),
        )
        info.update(
            max_prompt_len=o["max_prompt_len"],
            max_output_len=o.get("max_output_len"),
            max_total_len=max_total,
        )
        if len(requests) < o["num_prompts"]:
            raise ValueError(
                f"num_prompts: only {len(requests)} ShareGPT pairs pass the length rules"
            )
    elif name == "file":
        requests = file_workload(o["dataset_path"], encode, o["num_prompts"])
        info["dataset_path"] = o["dataset_path"]
    elif name == "random":
        requests = random_workload(
            o["num_prompts"], o["input_len"], o["output_len"], o["range_ratio"], vocab, o["seed"]
        )
        info.update(
            input_len=o["input_len"], output_len=o["output_len"], range_ratio=o["range_ratio"]
        )
    elif name == "prefix":
        requests = prefix_workload(
            o["num_prompts"],
            o["prefix_len"],
            o["num_prefixes"],
            o["suffix_len"],
            o["output_len"],
            vocab,
            o["seed"],
        )
        info.update(
            prefix_len=o["prefix_len"],
            num_prefixes=o["num_prefixes"],
            suffix_len=o["suffix_len"],
            output_len=o["output_len"],
        )
    else:
        raise ValueError(f"workload: unknown {name!r}")
    if not requests:
        raise ValueError(f"workload {name}: no requests")
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError(f"workload {name}: request ids are not unique")
    if name in ("sharegpt", "file") and engine.config.load_format == "dummy":
        # A dummy shape may have a smaller vocabulary than the tokenizer that made the ids.
        requests = fold_into_vocab(requests, vocab)
    return requests, info


def describe_workload(requests: Sequence[BenchRequest]) -> dict[str, Any]:
    p = [r.prompt_len for r in requests]
    o = [r.output_len for r in requests]
    return {
        "num_requests": len(requests),
        "prompt_tokens": sum(p),
        "output_tokens": sum(o),
        "prompt_len_mean": sum(p) / len(p),
        "prompt_len_max": max(p),
        "output_len_mean": sum(o) / len(o),
        "output_len_max": max(o),
    }
