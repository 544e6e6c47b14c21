"""Roles are modules: the runtime serves a role it has never heard of (a test-only one), through the
same job protocol, and each role's flags are checked before a worker starts."""

from __future__ import annotations

import subprocess
import sys
import uuid

import anyio
import pytest

from jetllm.producer.fleet import ask, instance_status
from jetllm.producer.registry import instances
from jetllm.schemas import ErrorCode, ErrorFrame, FinalFrame, HealthReport, PulledFrame, TokensFrame
from jetllm.subjects import codec
from jetllm.subjects.connection import connect
from jetllm.subjects.names import Names
from jetllm.workers import roles
from jetllm.workers.roles import ROLES, FlagNotForRole, GenerateRole, UnknownRole, check_flags

from .conftest import inproc_worker
from .fake_engine import FakeEngine
from .helpers.echo_role import EchoJob, EchoRole
from .jobs import RawInbox, wait_dead_letter

pytestmark = pytest.mark.anyio


async def echo(nc, names: Names, text: str, inbox: RawInbox) -> list:
    job = EchoJob(request_id=f"e-{uuid.uuid4().hex[:8]}", model="fake", text=text, reply_to=inbox.subject)
    await nc.jetstream().publish(names.jobs("echo", "fake"), codec.encode(job))
    return await inbox.until_end(timeout=10)


async def test_a_role_the_runtime_never_heard_of_is_served_through_the_job_protocol(nats_url, namespace):
    engine = FakeEngine()
    names = Names(namespace)
    nc = await connect(nats_url, name="echo-producer")
    try:
        async with inproc_worker(nats_url, engine, role=EchoRole, namespace=namespace) as w:
            async with RawInbox(nc) as inbox:
                frames = await echo(nc, names, "hello role world", inbox)
            pulled, accepted, *tokens, final = frames
            assert isinstance(pulled, PulledFrame) and pulled.worker == w.instance  # every role's
            assert type(accepted).__name__ == "AcceptedFrame" and accepted.worker == w.instance
            assert [t.text for t in tokens] == ["hello ", "role ", "world "]
            assert all(isinstance(t, TokensFrame) for t in tokens)
            assert [f.seq for f in frames[2:]] == [1, 2, 3, 4]  # numbered by the protocol, not the role
            assert isinstance(final, FinalFrame) and final.usage.completion_tokens == 3
            assert engine.started == 0  # the echo role never asked the engine to generate
            with anyio.fail_after(5):  # the final frame leaves before the job is acked and counted
                while (status := await instance_status(nc, names, w.instance)).extra["completed"] != "1":
                    await anyio.sleep(0.02)
            assert status.role == "echo" and status.state == "serving"
            with anyio.fail_after(5):
                while not (records := await instances(nc.jetstream(), names)):
                    await anyio.sleep(0.05)
            assert records[0].role == "echo"
            (health,) = await ask(nc, names, "health", instance=w.instance)
            assert isinstance(health, HealthReport) and health.healthy and health.canary_ok
            assert w.role.canaries == 1  # the role's own canary, not generate's
    finally:
        await nc.close()


async def test_a_role_s_typed_error_and_its_bug_each_fail_that_job_only(nats_url, namespace):
    names = Names(namespace)
    nc = await connect(nats_url, name="echo-producer")
    try:
        async with inproc_worker(nats_url, FakeEngine(), role=EchoRole, namespace=namespace):
            async with RawInbox(nc) as inbox:
                _, refused = await echo(nc, names, "refuse", inbox)
            assert isinstance(refused, ErrorFrame) and refused.code == ErrorCode.INVALID_REQUEST
            assert refused.field == "$.text"
            dead = await wait_dead_letter(nc, names, lambda d: d.code == ErrorCode.INVALID_REQUEST)
            assert dead.subject == names.jobs("echo", "fake")
            async with RawInbox(nc) as inbox:
                *_, broke = await echo(nc, names, "boom", inbox)
            assert isinstance(broke, ErrorFrame) and broke.code == ErrorCode.INTERNAL
            assert broke.message == "jetllm failed while echoing: RuntimeError: echo broke"
            async with RawInbox(nc) as inbox:
                *_, fine = await echo(nc, names, "still here", inbox)
            assert isinstance(fine, FinalFrame)
    finally:
        await nc.close()


WITH_ECHO = {"generate": GenerateRole, "echo": EchoRole}


@pytest.mark.parametrize(
    ("role", "given", "refused", "owner"),
    [
        ("generate", [], None, None),
        ("generate", ["--enable-lora", "--max-migrations", "--slots"], None, None),
        ("echo", ["--slots", "--grace-period", "--kv-events"], None, None),  # common to every role
        ("echo", ["--echo-loudly"], None, None),
        ("echo", ["--enable-lora"], "--enable-lora", "generate"),
        ("echo", ["--slots", "--max-migrations"], "--max-migrations", "generate"),
        ("generate", ["--echo-loudly"], "--echo-loudly", "echo"),
    ],
)
def test_a_flag_that_means_nothing_for_the_role_is_refused_naming_whose_it_is(role, given, refused, owner):
    if refused is None:
        assert check_flags(role, given, WITH_ECHO) is WITH_ECHO[role]
        return
    with pytest.raises(FlagNotForRole) as e:
        check_flags(role, given, WITH_ECHO)
    assert str(e.value).startswith(
        f"{refused} means nothing for --role {role}: it is a flag of the {owner} role"
    )


def test_the_kv_connector_flags_belong_to_both_disaggregated_roles_and_no_other():
    for role in ("prefill", "decode"):
        assert check_flags(role, ["--kv-connector", "--kv-connector-config"], ROLES) is ROLES[role]
    with pytest.raises(FlagNotForRole, match="--kv-connector means nothing for --role generate"):
        check_flags("generate", ["--kv-connector"], ROLES)


def test_an_unknown_role_is_refused_naming_the_roles_there_are():
    with pytest.raises(
        UnknownRole, match=r"--role 'prefill' is not a role of this worker; roles: echo, generate"
    ):
        check_flags("prefill", [], WITH_ECHO)


def test_the_worker_command_checks_its_flags_against_the_role(monkeypatch):
    from jetllm.cli import parser, worker_cmd, worker_flags

    monkeypatch.setitem(roles.ROLES, "echo", EchoRole)
    args = parser().parse_args(
        ["worker", "--role", "echo", "--slots", "4", "--enable-lora", "--lora-dir", "/x"]
    )
    assert sorted(worker_flags.given_flags(args)) == ["--enable-lora", "--lora-dir", "--role", "--slots"]
    refused = worker_cmd.check_role(args)
    assert refused is not None and refused.startswith("--enable-lora means nothing for --role echo")
    assert "(also: --lora-dir)" in refused
    ok = parser().parse_args(["worker", "--enable-lora", "--max-migrations", "5"])
    assert worker_cmd.check_role(ok) is None


def test_jetllm_worker_with_an_unknown_role_exits_before_connecting():
    r = subprocess.run(
        [sys.executable, "-m", "jetllm", "worker", "--role", "encode", "--nats", "nats://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "--role 'encode' is not a role of this worker; roles: decode, generate, prefill" in r.stderr


def test_every_role_in_the_registry_names_its_queue_and_flags():
    for name, cls in ROLES.items():
        assert cls.name == name and cls.queue and all(f.startswith("--") for f in cls.flags)
