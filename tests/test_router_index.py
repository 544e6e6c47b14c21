"""The router's block index and block ids, pure: events in, prefix overlaps out."""

from __future__ import annotations

import pytest

from jetllm.router.gaps import SeqCheck, check_seq
from jetllm.router.hashing import BlockHasher, lora_chain
from jetllm.router.index import BlockIndex
from jetllm.schemas import KvCleared, KvEventBatch, KvRemoved, KvResync, KvStored

B = 4
H = BlockHasher(B)
A = list(range(100, 116))  # 4 blocks
C = list(range(200, 216))


def stored(tokens: list[int], parent: int | None = None, lora: str | None = None, medium=None) -> KvStored:
    hashes = H.chain(tokens) if parent is None else [1000 + i for i in range(len(tokens) // B)]
    return KvStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=B,
        lora_name=lora,
        medium=medium,
    )


def test_block_ids_chain_over_the_prefix_and_lora_ids_never_meet_base_ones():
    assert H.chain(A) == H.chain(A + [1, 2])  # a partial block has no id
    assert len(H.chain(A)) == 4 and len(set(H.chain(A))) == 4
    assert H.chain(A)[:2] == H.chain(A[:8] + C[:8])[:2] and H.chain(A)[2] != H.chain(A[:8] + C[:8])[2]
    assert BlockHasher(B, seed="other").chain(A)[0] != H.chain(A)[0]
    base, one, two = H.chain(A), H.chain(A, "one"), H.chain(A, "two")
    assert not set(base) & set(one) and not set(one) & set(two)
    assert one == lora_chain("one", A, B)
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(0)


# (events per instance, applied in order) -> overlaps of A's chain per instance
CASES = [
    ("one store", {"w1": [stored(A)]}, {"w1": 4}),
    ("two holders, one shorter", {"w1": [stored(A)], "w2": [stored(A[:8])]}, {"w1": 4, "w2": 2}),
    (
        "an evicted middle block ends the prefix",
        {"w1": [stored(A), KvRemoved(block_hashes=[H.chain(A)[2]])]},
        {"w1": 2},
    ),
    (
        "evicting the first block ends everything",
        {"w1": [stored(A), KvRemoved(block_hashes=H.chain(A)[:1])]},
        {},
    ),
    ("a clear empties the instance", {"w1": [stored(A), KvCleared()], "w2": [stored(A[:4])]}, {"w2": 1}),
    ("clear then store again", {"w1": [stored(A), KvCleared(), stored(A[:12])]}, {"w1": 3}),
    (
        "a removal of another instance's block changes nothing",
        {"w1": [stored(A)], "w2": [KvRemoved(block_hashes=H.chain(A))]},
        {"w1": 4},
    ),
    ("other tiers do not count", {"w1": [stored(A, medium="CPU")]}, {}),
    ("another prompt does not match", {"w1": [stored(C)]}, {}),
    ("lora blocks never match base blocks", {"w1": [stored(A, lora="ad")]}, {}),
]


@pytest.mark.parametrize("case,events,expected", CASES, ids=[c[0] for c in CASES])
def test_index_applies_events_in_order(case, events, expected):
    index = BlockIndex()
    for inst, evs in events.items():
        index.apply(index.slot(inst), evs)
    assert index.overlap(H.chain(A)) == expected


def test_shared_blocks_go_back_to_one_holder_and_leave_nothing_behind():
    index = BlockIndex()
    slots = [index.slot(f"w{i}") for i in range(70)]  # beyond one machine word of holders
    for s in slots:
        index.apply(s, [stored(A)])
    assert index.overlap(H.chain(A)) == {f"w{i}": 4 for i in range(70)}
    for s in slots[1:]:
        index.apply(s, [KvRemoved(block_hashes=H.chain(A))])
    assert index.overlap(H.chain(A)) == {"w0": 4} and index.blocks == 4
    index.drop("w0")
    assert index.overlap(H.chain(A)) == {} and index.blocks == 0
    assert index.slot("new") == slots[0]  # slots are reused


def test_lora_chains_follow_the_engine_parent_and_removal():
    index = BlockIndex()
    s = index.slot("w1")
    first = KvStored(
        block_hashes=[7, 8], parent_block_hash=None, token_ids=A[:8], block_size=B, lora_name="ad"
    )
    more = KvStored(block_hashes=[9, 10], parent_block_hash=8, token_ids=A[8:], block_size=B, lora_name="ad")
    index.apply(s, [first, more])
    assert index.overlap(H.chain(A, "ad")) == {"w1": 4}
    index.apply(s, [KvRemoved(block_hashes=[9])])
    assert index.overlap(H.chain(A, "ad")) == {"w1": 2}
    orphan = KvStored(block_hashes=[12], parent_block_hash=99, token_ids=C[:4], block_size=B, lora_name="ad")
    index.apply(s, [orphan])  # its parent is unknown: it cannot be chained, so it is not indexed
    assert index.held("w1") == 3  # 7, 8 and 10 (held, though no prefix reaches it past 9)


def test_a_worker_hashing_with_another_seed_is_ignored_until_cleared():
    index = BlockIndex()
    s = index.slot("w1")
    other = BlockHasher(B, seed="1234")
    alien = KvStored(block_hashes=other.chain(A), token_ids=A, block_size=B)
    index.apply(s, [alien], H)
    assert index.is_foreign("w1") and index.overlap(other.chain(A)) == {}
    index.apply(s, [KvCleared(), stored(A)], H)
    assert not index.is_foreign("w1") and index.overlap(H.chain(A)) == {"w1": 4}


def test_the_per_instance_log_is_compacted_under_churn():
    index = BlockIndex()
    s = index.slot("w1")
    for i in range(3000):
        tokens = [i * 4 + t for t in range(B)]
        index.apply(s, [stored(tokens), KvRemoved(block_hashes=H.chain(tokens))])
    index.apply(s, [stored(A)])
    assert index.held("w1") == 4 and len(index._state(s).log) < 1100
    index.apply(s, [KvCleared()])
    assert index.blocks == 0


def _batch(seq: int, part: int | None = None) -> KvEventBatch:
    resync = KvResync(reason="requested", part=part, parts=2) if part else None
    return KvEventBatch(instance="w", model="m", seq=seq, events=[], resync=resync)


@pytest.mark.parametrize(
    "last,batch,verdict",
    [
        (None, _batch(1), SeqCheck.APPLY),
        (None, _batch(5), SeqCheck.UNKNOWN_START),
        (None, _batch(5, part=1), SeqCheck.APPLY),
        (None, _batch(6, part=2), SeqCheck.UNKNOWN_START),
        (4, _batch(5), SeqCheck.APPLY),
        (4, _batch(4), SeqCheck.STALE),
        (4, _batch(2), SeqCheck.STALE),
        (4, _batch(7), SeqCheck.GAP),
        (4, _batch(7, part=1), SeqCheck.APPLY),
        (4, _batch(1), SeqCheck.STALE),
    ],
)
def test_seq_checks(last, batch, verdict):
    assert check_seq(last, batch) is verdict


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(
            KvStored(block_hashes=[-1], parent_block_hash=5, token_ids=A[:4], block_size=B),
            id="a negative block hash",
        ),
        pytest.param(
            KvStored(block_hashes=[1], token_ids=A[:4], block_size=0, lora_name="ad"), id="a block size of 0"
        ),
    ],
)
def test_an_event_that_cannot_be_applied_is_skipped_alone(bad):
    """Events come from outside the router: one it cannot apply must not cost the rest of its batch
    (the feed would otherwise replay the whole stream)."""
    index = BlockIndex()
    s = index.slot("w1")
    index.apply(s, [bad, stored(A)], H)
    assert index.overlap(H.chain(A)) == {"w1": 4} and index.bad_events == 1


def test_lora_block_ids_take_any_token_id_a_job_may_hold():
    assert len(lora_chain("ad", [1, 2, 3, 2**40], B)) == 1
