"""Each side that starts on an existing stream changes only what it owns or needs: a producer's
defaults do not undo the settings an operator gave the workers, whoever connects last."""

from __future__ import annotations

import dataclasses

import pytest
from nats.js.api import StreamConfig

from jetllm.producer import Client
from jetllm.subjects.connection import connect
from jetllm.subjects.names import Names
from jetllm.subjects.policy import QueuePolicy
from jetllm.subjects.setup import ensure_streams
from jetllm.subjects.streamupdate import Wanted, update_for

CURRENT = StreamConfig(
    name="S", subjects=["a.*"], max_age=3600.0, duplicate_window=120.0, num_replicas=3, allow_direct=True
)
WANT = StreamConfig(
    name="S", subjects=["a.*"], max_age=86400.0, duplicate_window=600.0, num_replicas=1, allow_direct=True
)


@pytest.mark.parametrize(
    "wanted, rescale, changes",
    [
        (Wanted(WANT), False, None),  # defaults only: nothing changes
        (Wanted(WANT), True, {"num_replicas": 1}),  # replicas only when named
        (Wanted(WANT, owned=("max_age",)), False, {"max_age": 86400.0}),
        (Wanted(WANT, owned=("max_age", "duplicate_window")), False, {"max_age": 86400.0, "duplicate_window": 600.0}),
        (Wanted(CURRENT, owned=("max_age",)), False, None),  # already so
        (Wanted(WANT, raised=("max_age",)), False, {"max_age": 86400.0}),
        (Wanted(dataclasses.replace(WANT, max_age=60.0), raised=("max_age",)), False, None),  # never lowered
        (Wanted(dataclasses.replace(WANT, subjects=["b.*"])), False, {"subjects": ["a.*", "b.*"]}),
        (Wanted(dataclasses.replace(WANT, subjects=[])), False, None),  # an older side's subjects stay
    ],
)  # fmt: skip
def test_an_existing_stream_changes_only_in_what_the_side_owns_or_needs(wanted, rescale, changes):
    update = update_for(CURRENT, wanted, rescale=rescale)
    if changes is None:
        assert update is None
    else:
        assert update == dataclasses.replace(CURRENT, **changes)


def test_direct_gets_are_turned_on_and_an_unlimited_age_is_not_limited():
    update = update_for(dataclasses.replace(CURRENT, allow_direct=False), Wanted(WANT), rescale=False)
    assert update is not None and update.allow_direct
    rolls = dataclasses.replace(WANT, allow_rollup_hdrs=True)
    update = update_for(CURRENT, Wanted(rolls), rescale=False)
    assert update == dataclasses.replace(CURRENT, allow_rollup_hdrs=True)
    assert update_for(update, Wanted(WANT), rescale=False) is None  # a side that needs none leaves it
    unlimited = dataclasses.replace(CURRENT, max_age=0.0)
    assert update_for(unlimited, Wanted(WANT, raised=("max_age",)), rescale=False) is None


@pytest.mark.anyio
async def test_a_producer_leaves_the_workers_queue_settings_and_a_worker_naming_one_changes_it(
    nats_url, namespace
):
    names = Names(namespace)
    nc = await connect(nats_url)
    js = nc.jetstream()
    try:
        workers = QueuePolicy(max_age=7200.0, duplicate_window=60.0, results_max_age=3 * 86400.0)
        await ensure_streams(js, names, workers)
        async with Client(nats_url, namespace=namespace):  # its defaults: 24 h, 600 s, 24 h
            pass
        await ensure_streams(js, names, QueuePolicy())  # a worker of another pool, without the flags
        jobs = (await js.stream_info(names.jobs_stream)).config
        assert (jobs.max_age, jobs.duplicate_window) == (7200.0, 60.0)
        assert (await js.stream_info(names.requests_stream)).config.max_age == 3 * 86400.0
        assert (await js.stream_info(names.cancels_stream)).config.max_age == 7200.0

        await ensure_streams(js, names, QueuePolicy(max_age=4 * 86400.0))  # the operator raises it
        assert (await js.stream_info(names.jobs_stream)).config.max_age == 4 * 86400.0
        assert (await js.stream_info(names.requests_stream)).config.max_age == 4 * 86400.0  # outlives a job

        cancels = (await js.stream_info(names.cancels_stream)).config
        await js.update_stream(dataclasses.replace(cancels, subjects=[f"jetllm.{namespace}.older.*"]))
        await ensure_streams(js, names, QueuePolicy())  # this version's subject comes back beside it
        subjects = (await js.stream_info(names.cancels_stream)).config.subjects
        assert subjects == [f"jetllm.{namespace}.older.*", names.cancelled_all]
    finally:
        await nc.close()
