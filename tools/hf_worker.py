"""Peer worker: the workload through transformers (run with this repo's .venv python).

Modes:
  static   model.generate on static batches of --batch-size requests, in workload order,
           left-padded with an explicit attention mask; each batch runs until its longest
           output (request-level batching: the shorter rows compute padding tokens, which
           are not counted as output). EOS is held back with min_new_tokens so every row
           reaches its length (the ignore_eos of the other systems).
  cb       transformers' continuous batching (ContinuousBatchingManager, sdpa attention
           over its paged cache), one request per item with its own max_new_tokens and
           EOS disabled (eos_token_id=-1).
  convert  GGUF -> safetensors folder (fp32) + tokenizer, for vLLM and the two modes above.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from tools.peer_common import (
    PROCESS_START,
    Result,
    TimedWindow,
    check_lengths,
    fill_window,
    load_workload,
    run_worker,
    worker_args,
)


def convert(gguf_file: Path, out_dir: Path) -> None:
    """Dequantize the GGUF with transformers and save it as a plain fp32 safetensors folder.

    The loaded model still carries the GGUF quantizer (and config.quantization_config);
    both are cleared so that save_pretrained writes ordinary weights that vLLM and
    transformers load as an unquantized model.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    model: Any = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    tok.save_pretrained(tmp)
    tmp.rename(out_dir)  # the folder appears complete or not at all


def load_model(path: str) -> Any:
    """The model in fp32 with sdpa attention; the workload is token ids, so no tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    return model


def pad_token_id(config: Any) -> int:
    """The id that fills the left padding (masked out, so any id works): the model's pad
    token, else its (first) EOS token, else 0."""
    for tid in (config.pad_token_id, config.eos_token_id):
        if isinstance(tid, list):
            tid = tid[0] if tid else None
        if tid is not None:
            return int(tid)
    return 0


def run_static(args: argparse.Namespace, result: Result) -> None:
    import torch

    items = load_workload(args.workload)
    model = load_model(args.model)
    pad = pad_token_id(model.config)
    bs = args.batch_size

    def generate(batch: list[list[int]], new_tokens: int) -> torch.Tensor:
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        # Left padding: the last column is every row's last prompt token.
        for row, p in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        return out[:, width:]

    generate([items[0].prompt_token_ids[:8]], 2)  # warm-up
    result.startup_s = time.perf_counter() - PROCESS_START
    outputs: list[list[int]] = []
    padded_rows = 0
    with TimedWindow() as w:
        for start in range(0, len(items), bs):
            batch = items[start : start + bs]
            longest = max(it.output_len for it in batch)
            new = generate([it.prompt_token_ids for it in batch], longest)
            if new.shape[1] != longest:
                raise RuntimeError(f"generate returned {new.shape[1]} tokens, asked {longest}")
            for row, it in enumerate(batch):
                outputs.append(new[row, : it.output_len].tolist())
                padded_rows += longest - it.output_len
            if result.first_finished_s is None:
                result.first_finished_s = time.perf_counter() - PROCESS_START
    fill_window(result, w)
    result.output_token_ids = outputs
    check_lengths(result, items)
    result.prompt_tokens = sum(len(it.prompt_token_ids) for it in items)
    result.output_tokens = sum(it.output_len for it in items)
    result.extra = {"padding_decode_tokens": float(padded_rows)}
    result.detail = f"generate, static batches of {bs}, sdpa, fp32, left padding"


def run_cb(args: argparse.Namespace, result: Result) -> None:
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig

    items = load_workload(args.workload)
    model = load_model(args.model)
    longest_seq = max(len(it.prompt_token_ids) + it.output_len for it in items)
    # Paged cache sized for every request at once (page_size tokens per block, all layers).
    page = 256
    blocks = len(items) * -(-longest_seq // page) + 8
    cb_config = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=blocks,
        max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs,
        auto_switch_to_flash=False,
    )
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max(it.output_len for it in items), eos_token_id=-1
    )
    outputs: dict[str, list[int]] = {}
    with (
        torch.inference_mode(),
        model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb_config, block=True, timeout=30
        ) as manager,
    ):
        result.startup_s = time.perf_counter() - PROCESS_START
        with TimedWindow() as w:
            for it in items:
                manager.add_request(
                    it.prompt_token_ids,
                    request_id=it.request_id,
                    max_new_tokens=it.output_len,
                    eos_token_id=-1,
                )
            while len(outputs) < len(items):
                r = manager.get_result(timeout=1)
                if r is None:
                    if not manager.is_running():
                        raise RuntimeError("the continuous batching thread stopped")
                    continue
                if r.is_finished():
                    if r.error is not None:
                        raise RuntimeError(f"request {r.request_id}: {r.error}")
                    if result.first_finished_s is None:
                        result.first_finished_s = time.perf_counter() - PROCESS_START
                    outputs[r.request_id] = list(r.generated_tokens)
        fill_window(result, w)
    result.output_token_ids = [outputs[it.request_id] for it in items]
    check_lengths(result, items)
    result.prompt_tokens = sum(len(it.prompt_token_ids) for it in items)
    result.output_tokens = sum(it.output_len for it in items)
    result.detail = (
        f"ContinuousBatchingManager, {model.config._attn_implementation} attention, "
        f"{blocks} blocks x {page} tokens, max_batch_tokens {args.max_num_batched_tokens}, fp32"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "convert":
        convert(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    p = worker_args(__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["static", "cb"], required=True)
    args = p.parse_args()
    if args.mode == "static":
        run_worker(
            f"transformers generate (static B={args.batch_size})",
            args.out,
            lambda r: run_static(args, r),
        )
    else:
        run_worker("transformers continuous batching", args.out, lambda r: run_cb(args, r))


if __name__ == "__main__":
    main()
