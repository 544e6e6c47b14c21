"""Where a decode worker prefills: the decision, case by case."""

from __future__ import annotations

import pytest

from jetllm.kvtransfer.params import full_block_tokens
from jetllm.workers.roles.decode.policy import PrefillQueue, decide

IDLE = PrefillQueue(workers_waiting=1, queued=0, running=0)
BUSY = PrefillQueue(workers_waiting=0, queued=3, running=2)
GONE = PrefillQueue(workers_waiting=0, queued=5, running=0)


@pytest.mark.parametrize(
    ("prompt", "queue", "extra", "reason"),
    [
        (300, IDLE, {}, "remote"),
        (300, BUSY, {}, "remote"),
        (100, IDLE, {}, "local_short"),
        (300, None, {}, "local_no_prefill_worker"),
        (300, GONE, {}, "local_no_prefill_worker"),
        (300, PrefillQueue(workers_waiting=0, queued=16, running=4), {}, "local_queue_full"),
        (300, IDLE, {"continuation": True}, "local_continuation"),
        (300, IDLE, {"embeds": True}, "local_embeds"),
        (300, IDLE, {"adapter": True}, "local_adapter"),
    ],
)
def test_where_a_prompt_is_prefilled(prompt, queue, extra, reason):
    d = decide(
        prompt,
        full_block_tokens=full_block_tokens(prompt, 32),
        threshold=256,
        queue=queue,
        max_queue=16,
        **extra,
    )
    assert d.reason == reason and d.remote == (reason == "remote")


@pytest.mark.parametrize(
    ("prompt", "cached", "fraction", "queue", "extra", "reason"),
    [
        (300, 160, 0.5, IDLE, {}, "local_cached"),
        (300, 144, 0.5, IDLE, {}, "remote"),  # under half: the rest is worth a prefill worker
        (300, 150, 0.5, IDLE, {}, "local_cached"),  # exactly half counts
        (300, 288, 0.0, IDLE, {}, "remote"),  # 0 turns the condition off
        (300, 288, 1.0, IDLE, {}, "remote"),
        (256, 256, 1.0, IDLE, {}, "local_cached"),
        (300, 0, 0.5, IDLE, {}, "remote"),
        (300, 160, 0.5, None, {}, "local_cached"),  # cached wins over a missing prefill worker
        (300, 160, 0.5, PrefillQueue(workers_waiting=0, queued=16, running=4), {}, "local_cached"),
        (100, 96, 0.5, IDLE, {}, "local_short"),  # short is said first
        (300, 160, 0.5, IDLE, {"embeds": True}, "local_embeds"),  # no block ids: never cached
        (300, 160, 0.5, IDLE, {"adapter": True}, "local_adapter"),
        (300, 160, 0.5, IDLE, {"continuation": True}, "local_continuation"),
    ],
)
def test_a_prompt_mostly_in_the_prefix_cache_is_prefilled_here(
    prompt, cached, fraction, queue, extra, reason
):
    d = decide(
        prompt,
        full_block_tokens=full_block_tokens(prompt, 16),
        threshold=256,
        queue=queue,
        max_queue=16,
        cached_tokens=cached,
        min_cached=fraction,
        **extra,
    )
    assert d.reason == reason and d.remote == (reason == "remote")


def test_a_prompt_that_fills_no_block_stays_local_whatever_the_threshold():
    d = decide(32, full_block_tokens=full_block_tokens(32, 32), threshold=0, queue=IDLE, max_queue=16)
    assert d.reason == "local_short"


@pytest.mark.parametrize(
    ("prompt", "block", "covered"), [(0, 32, 0), (32, 32, 0), (33, 32, 32), (150, 32, 128), (65, 16, 64)]
)
def test_a_block_file_covers_the_full_blocks_before_the_last_token(prompt, block, covered):
    assert full_block_tokens(prompt, block) == covered
