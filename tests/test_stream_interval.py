"""How many tokens a frame carries (OutputOptions.stream_interval): what the worker asks the
engine for, per kind of job."""

from __future__ import annotations

import pytest

from jetllm.schemas import GenerateRequest, OutputOptions, TokensPrompt
from jetllm.workers.engine.sampling import DETACHED_STREAM_INTERVAL, stream_interval


@pytest.mark.parametrize(
    ("reply_to", "asked", "engine"),
    [
        ("_INBOX.a", None, None),  # someone reads every token: every engine step
        (None, None, DETACHED_STREAM_INTERVAL),  # detached: nobody watches it
        ("_INBOX.a", 8, 8),
        (None, 1, 1),  # a detached job may still ask for every token
    ],
)
def test_stream_interval(reply_to, asked, engine):
    req = GenerateRequest(
        request_id="r",
        model="m",
        prompt=TokensPrompt([1, 2]),
        reply_to=reply_to,
        output=OutputOptions(stream_interval=asked),
    )
    assert stream_interval(req) == engine
