"""What a namespace's streams look like for a side's policy (jetllm/subjects/streams.py), without
a server: what each side owns, where it stores, and the rules that keep jobs answerable."""

import pytest
from nats.js.api import StorageType

from jetllm.subjects.names import Names
from jetllm.subjects.policy import QueuePolicy
from jetllm.subjects.streams import namespace_streams, requests_stream

NAMES = Names("ns")


def owned(policy: QueuePolicy) -> dict[str, tuple[str, ...]]:
    return {w.config.name: tuple(w.owned) for w in namespace_streams(NAMES, policy, 1)}


def test_a_side_that_names_no_setting_changes_nothing_on_existing_streams():
    assert all(fields == () for fields in owned(QueuePolicy()).values())


@pytest.mark.parametrize(
    ("policy", "stream", "fields"),
    [
        (QueuePolicy(max_age=60), NAMES.jobs_stream, ("max_age",)),
        (QueuePolicy(max_age=60), NAMES.cancels_stream, ("max_age",)),
        (QueuePolicy(max_age=60), NAMES.requests_stream, ()),  # raised, not owned: see below
        (QueuePolicy(results_max_age=60), NAMES.requests_stream, ("max_age",)),
        (QueuePolicy(results_max_age=60), NAMES.traces_stream, ("max_age",)),
        (QueuePolicy(dlq_max_age=60), NAMES.dlq_stream, ("max_age",)),
        (QueuePolicy(kv_events_max_age=60), NAMES.jobs_stream, ()),
        (QueuePolicy(duplicate_window=30), NAMES.traces_stream, ()),
    ],
)
def test_a_named_setting_is_owned_on_exactly_the_streams_it_configures(policy, stream, fields):
    assert owned(policy)[stream] == fields


@pytest.mark.parametrize(
    ("results_max_age", "max_age", "kept"),
    [(3600, 60, 3600), (60, 3600, 3600), (None, 7 * 86400, 7 * 86400), (None, None, 86400)],
)
def test_results_outlive_every_job_that_may_still_be_pulled(results_max_age, max_age, kept):
    wanted = requests_stream(NAMES, QueuePolicy(results_max_age=results_max_age, max_age=max_age), 1)
    assert wanted.config.max_age == kept
    assert tuple(wanted.raised) == (("max_age",) if max_age is not None else ())


@pytest.mark.parametrize(("memory", "storage"), [(True, StorageType.MEMORY), (False, StorageType.FILE)])
def test_every_stream_stores_where_the_policy_says_with_the_replicas_given(memory, storage):
    streams = namespace_streams(NAMES, QueuePolicy(memory=memory), 3)
    assert {w.config.storage for w in streams} == {storage}
    assert {w.config.num_replicas for w in streams} == {3}


def test_streams_take_disjoint_subjects_within_and_across_namespaces():
    ours = namespace_streams(NAMES, QueuePolicy(), 1)
    theirs = namespace_streams(Names("other"), QueuePolicy(), 1)
    assert ours[0].config.name == NAMES.jobs_stream  # created first: the others follow its replicas
    subjects = [s for w in ours for s in w.config.subjects or []]
    other = {s for w in theirs for s in w.config.subjects or []}
    assert len(subjects) == len(set(subjects)) and not other & set(subjects)
    assert not {w.config.name for w in ours} & {w.config.name for w in theirs}
