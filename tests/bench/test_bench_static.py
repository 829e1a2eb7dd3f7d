"""The static (request-level) policy really pads and really waits for the slowest member:
every computed position of every step is checked against a hand count."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cbgen.config import EngineConfig
from cbgen.engine.engine import Engine
from cbgen.engine.outputs import RequestOutput
from cbgen.engine.static_scheduler import PAD_ID_PREFIX
from cbgen.sampling_params import SamplingParams
from tools.model_shapes import TINY_LLAMA


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """A tiny dummy-weight llama (no tokenizer: token-id prompts), loaded once."""
    folder = tmp_path_factory.mktemp("tiny-static")
    config = {**TINY_LLAMA, "max_position_embeddings": 256}
    (folder / "config.json").write_text(json.dumps(config))
    return Engine(
        EngineConfig(model=str(folder), load_format="dummy", kv_cache_memory=4 << 20, num_threads=1)
    )


def make_engine(weights: Engine, **overrides: Any) -> Engine:
    cfg = weights.config.replace(
        **{"block_size": 4, "max_num_batched_tokens": 512, "max_num_seqs": 8, **overrides}
    )
    return Engine(cfg, share_weights_with=weights)


# (prompt length, output length); distinct token ranges, so no prefix-cache hits
SPECS = [(5, 4), (9, 2), (3, 6), (4, 3)]
FIRST_TOKEN = [10, 100, 200, 300]


def run(
    engine: Engine,
) -> tuple[
    list[list[tuple[str, int, int, bool]]],
    list[list[int]],
    dict[str, tuple[int, RequestOutput]],
    list[int],
]:
    """Per step: what was scheduled (id, computed, new, samples), the positions the runner
    computed; per request: the step it came back in and its output; slots held per step."""
    scheduled: list[list[tuple[str, int, int, bool]]] = []
    positions: list[list[int]] = []
    prepare = engine.runner.prepare_inputs

    def spy(out: Any) -> Any:
        scheduled.append(
            [
                (s.request_id, s.num_computed_tokens, s.num_new_tokens, s.will_sample)
                for s in out.scheduled
            ]
        )
        result = prepare(out)
        positions.append(result[1].tolist())
        return result

    engine.runner.prepare_inputs = spy  # type: ignore[method-assign]
    for i, ((n, out_len), first) in enumerate(zip(SPECS, FIRST_TOKEN, strict=True)):
        engine.add_request(
            f"r{i}",
            list(range(first, first + n)),
            SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0),
        )
    done: dict[str, tuple[int, RequestOutput]] = {}
    running: list[int] = []
    step = 0
    while engine.has_unfinished_requests():
        out = engine.step()
        step += 1
        running.append(out.stats.num_running)
        for o in out.finished:
            done[o.request_id] = (step, o)
    return scheduled, positions, done, running


def pad(member: str) -> str:
    return f"{PAD_ID_PREFIX}0/{member}"


def test_static_pads_and_waits_for_the_slowest_member(weights: Engine) -> None:
    engine = make_engine(weights, scheduling_policy="static", static_batch_size=3)
    scheduled, positions, done, running = run(engine)
    # Batch 1 = r0, r1, r2: longest prompt 9, so r0 is padded by 4 and r2 by 6; the pads come
    # first and never sample; the slowest member (r2, 6 tokens) holds everyone for 6 steps.
    assert scheduled[0] == [
        (pad("r0"), 0, 4, False),
        (pad("r2"), 0, 6, False),
        ("r0", 0, 5, True),
        ("r1", 0, 9, True),
        ("r2", 0, 3, True),
    ]
    assert positions[0] == [*range(4), *range(6), *range(5), *range(9), *range(3)]
    for k in range(1, 6):  # steps 2..6: every member computes one token, done or not
        assert scheduled[k] == [
            ("r0", 4 + k, 1, True),
            ("r1", 8 + k, 1, True),
            ("r2", 2 + k, 1, True),
        ]
        assert positions[k] == [4 + k, 8 + k, 2 + k]
    # Batch 2 = r3 alone, only once batch 1 has fully finished.
    assert scheduled[6] == [("r3", 0, 4, True)]
    assert scheduled[7:] == [[("r3", 4, 1, True)], [("r3", 5, 1, True)]]
    assert len(scheduled) == 9
    # Results of a batch come back together, when its slowest member is done.
    assert {rid: step for rid, (step, _) in done.items()} == {"r0": 6, "r1": 6, "r2": 6, "r3": 9}
    for i, (_, out_len) in enumerate(SPECS):
        o = done[f"r{i}"][1]
        assert o.num_output_tokens == out_len and o.finish_reason == "length"
    # Finished members keep their slots (counted after each step, so 0 once a batch is over).
    assert running == [3] * 5 + [0] + [1] * 2 + [0]
    r1 = done["r1"][1].metrics
    assert r1.e2e_s is not None and r1.ttft_s is not None
    assert r1.e2e_s > r1.ttft_s + r1.tpot_s  # r1 was done at step 2 but returned at step 6
    assert done["r3"][1].metrics.queue_s > done["r2"][1].metrics.ttft_s  # type: ignore[operator]
    # Hand count: pads 4 + 6; members' prompts 5 + 9 + 3 + 4; decodes 5 x 3 + 2; of the
    # decodes, r0 computed 2 and r1 4 after they were done.
    stats = engine.padding_stats
    assert stats is not None
    assert (stats.num_pad_tokens, stats.num_discarded_tokens) == (10, 6)
    assert stats.num_computed_tokens == sum(len(p) for p in positions) == 10 + 21 + 17
    assert stats.waste == pytest.approx(16 / 48)
    assert stats.num_batches == 2
    assert engine.kv.num_used_blocks == 0
    engine.step()  # hands the last finished ids to the runner
    assert sorted(engine.runner.free_rows) == list(range(8))


def test_continuous_neither_pads_nor_waits(weights: Engine) -> None:
    engine = make_engine(weights)
    scheduled, _, done, _ = run(engine)
    assert scheduled[0] == [
        ("r0", 0, 5, True),
        ("r1", 0, 9, True),
        ("r2", 0, 3, True),
        ("r3", 0, 4, True),
    ]
    assert {rid: step for rid, (step, _) in done.items()} == {"r0": 4, "r1": 2, "r2": 6, "r3": 3}
    assert sum(n for step in scheduled for _, _, n, _ in step) == 21 + (3 + 1 + 5 + 2)


def test_static_pads_wait_for_runner_rows(weights: Engine) -> None:
    """With as many slots as members, pads take rows first; a member is admitted once a pad
    has finished computing and given its row back (its KV blocks stay held)."""
    engine = make_engine(weights, scheduling_policy="static", static_batch_size=3, max_num_seqs=3)
    scheduled, _, done, running = run(engine)
    assert scheduled[0] == [(pad("r0"), 0, 4, False), (pad("r2"), 0, 6, False), ("r0", 0, 5, True)]
    assert scheduled[1] == [("r0", 5, 1, True), ("r1", 0, 9, True), ("r2", 0, 3, True)]
    # r2 samples its first token at step 2, so the batch ends at step 7
    assert {rid: step for rid, (step, _) in done.items()} == {"r0": 7, "r1": 7, "r2": 7, "r3": 10}
    assert [done[f"r{i}"][1].num_output_tokens for i in range(4)] == [4, 2, 6, 3]
    assert running[:7] == [3] * 6 + [0]
    assert engine.kv.num_used_blocks == 0


def test_static_abort_leaves_the_batch(weights: Engine) -> None:
    engine = make_engine(weights, scheduling_policy="static", static_batch_size=3)
    for i, ((n, out_len), first) in enumerate(zip(SPECS, FIRST_TOKEN, strict=True)):
        engine.add_request(
            f"r{i}",
            list(range(first, first + n)),
            SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0),
        )
    engine.step()
    aborted = engine.abort(["r2"])  # the slowest member goes: the batch now ends with r0
    assert [o.finish_reason for o in aborted] == ["abort"]
    steps = {}
    k = 1
    while engine.has_unfinished_requests():
        k += 1
        for o in engine.step().finished:
            steps[o.request_id] = (k, o.num_output_tokens)
    assert steps == {"r0": (4, 4), "r1": (4, 2), "r3": (7, 3)}
    assert engine.kv.num_used_blocks == 0
    engine.step()  # hands the last finished ids to the runner
    assert sorted(engine.runner.free_rows) == list(range(8))


def test_static_batch_is_cut_where_the_padded_rows_would_not_fit(weights: Engine) -> None:
    """A batch takes only as many requests as the KV cache holds for the padded batch run to
    its end; the cache below holds r0 + r1 padded but not r2 as well."""
    block_bytes = weights.kv_bytes_per_block // 4  # block_size 4 instead of 16
    # r0 and r1 padded to 9, run to 4 tokens: blocks(5+4) + blocks(4) + blocks(9+4) = 3 + 1 + 4
    engine = make_engine(
        weights, scheduling_policy="static", static_batch_size=3, kv_cache_memory=8 * block_bytes
    )
    _, _, done, _ = run(engine)
    assert {rid: step for rid, (step, _) in done.items()} == {"r0": 4, "r1": 4, "r2": 10, "r3": 10}
    assert [done[f"r{i}"][1].num_output_tokens for i in range(4)] == [4, 2, 6, 3]
    assert engine.total_preemptions == 0
