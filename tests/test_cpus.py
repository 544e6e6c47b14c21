"""Cores for engines sharing a host: disjoint shares, and the operator's binding left alone."""

from __future__ import annotations

import pytest

from jetllm import cpus


@pytest.mark.parametrize(
    ("cores", "index", "engines", "bound"),
    [
        (2, 0, 2, "0"),
        (2, 1, 2, "1"),
        (2, 2, 2, "0"),  # the third worker started shares with the first
        (8, 0, 2, "0,1,2,3"),
        (8, 1, 2, "4,5,6,7"),
        (2, 2, 3, "0"),  # more engines than cores: round robin
        (2, 0, 1, None),  # a lone engine keeps vLLM's own choice
    ],
)
def test_each_engine_gets_its_own_share_of_the_cores(monkeypatch, cores, index, engines, bound):
    monkeypatch.delenv(cpus.BIND, raising=False)
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert cpus.engine_cores(index, engines).get(cpus.BIND) == bound


def test_a_binding_the_operator_chose_wins(monkeypatch):
    monkeypatch.setenv(cpus.BIND, "0-3|4-7")
    assert cpus.engine_cores(1, 2) == {}
