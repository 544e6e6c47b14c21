"""Who may do what (subjects/permissions.py), the server configuration made from it, the errors a
refusal becomes, and the connection settings read from the environment: pure, no server, except
nats-server checking the shipped configuration."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from jetllm.errors import InsecureConnection, NatsSettingsError
from jetllm.natsserver import find_binary
from jetllm.subjects.connection import Security, redact
from jetllm.subjects.denials import parse_refusal, refusal_message
from jetllm.subjects.names import Names
from jetllm.subjects.natsconfig import User, accounts_config, default_users, parse_user
from jetllm.subjects.permissions import inbox_prefix, matches, namespace_of, roles_allowed

ROOT = Path(__file__).resolve().parent.parent
N = Names("prod-eu")
JS = "$JS.API"


@pytest.mark.parametrize(
    "pattern, subject, expected",
    [
        ("a.b", "a.b", True),
        ("a.*", "a.b", True),
        ("a.*", "a.b.c", False),
        ("a.>", "a.b.c", True),
        ("a.>", "a", False),
        ("a.*.c", "a.b.c", True),
        ("a.*.c", "a.b.d", False),
        ("a.b", "a.b.c", False),
    ],
)
def test_subject_matching_follows_nats(pattern, subject, expected):
    assert matches(pattern, subject) is expected


@pytest.mark.parametrize(
    "subject, namespace",
    [
        ("jetllm.prod-eu.ctl.m.tiny.sleep", "prod-eu"),
        (f"{JS}.STREAM.CREATE.JETLLM_PROD_EU_JOBS", "prod-eu"),
        (f"{JS}.CONSUMER.CREATE.KV_JETLLM_PROD_EU_REGISTRY.abc.$KV.JETLLM_PROD_EU_REGISTRY.i.x", "prod-eu"),
        ("$kv.jetllm_prod_eu_lora.tiny.a", "prod-eu"),  # nats-py reports refusals lower-cased
        ("$O.JETLLM_KV_EMBEDS.C.x", "kv"),
        ("_INBOX.alice.x", None),
        ("orders.new", None),
    ],
)
def test_the_namespace_of_a_subject_is_read_back_from_it(subject, namespace):
    assert namespace_of(subject) == namespace


MAY = [
    # (what, op, subject, the roles that may)
    # workers publish to the shared queues too: they move directed jobs there (their own when they
    # stop, a dead instance's when they sweep)
    ("submit a job", "publish", N.jobs("generate", "tiny"), ["producer", "router", "worker", "admin"]),
    (
        "address a job to an instance",
        "publish",
        N.directed_jobs("generate", "tiny", "w1"),
        ["producer", "router", "admin"],
    ),
    (
        "check the instance a job is addressed to",
        "publish",
        f"{JS}.DIRECT.GET.KV_{N.registry_bucket}.$KV.{N.registry_bucket}.i.w1",
        ["producer", "router", "worker", "admin"],
    ),
    (
        "hear jobs addressed to it",
        "subscribe",
        N.directed_jobs("generate", "tiny", "w1"),
        ["worker", "admin"],
    ),
    (
        "take a moved directed job out of the stream",
        "publish",
        f"{JS}.STREAM.MSG.DELETE.{N.jobs_stream}",
        ["worker", "admin"],
    ),
    (
        "submit a job for the routers",
        "publish",
        N.routing("generate", "tiny"),
        ["producer", "router", "admin"],
    ),
    ("make the routing queue", "publish", f"{JS}.STREAM.CREATE.{N.routing_stream}", ["router", "admin"]),
    (
        "take a job from the routing queue",
        "publish",
        f"{JS}.CONSUMER.MSG.NEXT.{N.routing_stream}.{N.routing_consumer('generate', 'tiny')}",
        ["router", "admin"],
    ),
    ("ack a placed job", "publish", f"$JS.ACK.{N.routing_stream}.x.1.2.3.4.5", ["router", "admin"]),
    ("trace a placement", "publish", N.trace("r1"), ["router", "worker", "admin"]),
    (
        "read a shared queue's depth (gateway --max-queue)",
        "publish",
        f"{JS}.CONSUMER.INFO.{N.jobs_stream}.{N.consumer('generate', 'tiny')}",
        ["router", "worker", "admin"],
    ),
    (
        "make the KV blocks' stream",
        "publish",
        f"{JS}.STREAM.CREATE.{N.kv_blocks_stream}",
        ["worker", "admin"],
    ),
    ("cancel a request", "publish", N.cancel("r1"), ["producer", "router", "worker", "admin"]),
    ("cancel a queued request", "publish", N.cancelled("r1"), ["producer", "router", "admin"]),
    ("write a request's log (forge its result)", "publish", N.request_log("r1"), ["worker", "admin"]),
    (
        "read a durable cancel",
        "publish",
        f"{JS}.DIRECT.GET.{N.cancels_stream}.{N.cancelled('r1')}",
        ["worker", "admin"],
    ),
    ("create the cancels' stream", "publish", f"{JS}.STREAM.CREATE.{N.cancels_stream}", ["worker", "admin"]),
    ("ping a worker", "publish", N.instance_control("w1", "ping"), ["producer", "router", "worker", "admin"]),
    (
        "nak a job",
        "publish",
        f"$JS.ACK.{N.jobs_stream}.generate_tiny.1.2.3.4.5",
        ["producer", "router", "worker", "admin"],
    ),
    ("ask for status", "publish", N.control("status"), ["router", "admin"]),
    ("ask for a KV snapshot", "publish", N.model_control("tiny", "kv-resync"), ["router", "admin"]),
    ("sleep a model", "publish", N.model_control("tiny", "sleep"), ["admin"]),
    ("sleep an instance", "publish", N.instance_control("w1", "sleep"), ["admin"]),
    ("load an adapter (verb)", "publish", N.model_control("tiny", "lora-load"), ["admin"]),
    ("change desired adapters", "publish", f"$KV.{N.lora_bucket}.tiny.a", ["admin"]),
    ("push adapter files", "publish", f"$O.{N.adapters_store}.C.x", ["admin"]),
    ("write the registry", "publish", f"$KV.{N.registry_bucket}.i.w1", ["worker", "admin"]),
    ("dead-letter a job", "publish", N.dlq("generate", "tiny"), ["worker", "admin"]),
    ("report load", "publish", N.load("tiny", "w1"), ["worker", "admin"]),
    ("publish KV events", "publish", N.kv_events("tiny", "w1"), ["worker", "admin"]),
    ("forge a max-deliveries advisory", "publish", N.max_deliveries_advisory("generate", "tiny"), []),
    ("create the job stream", "publish", f"{JS}.STREAM.CREATE.{N.jobs_stream}", ["worker", "admin"]),
    ("delete the job stream", "publish", f"{JS}.STREAM.DELETE.{N.jobs_stream}", ["admin"]),
    (
        "delete the workers' consumer",
        "publish",
        f"{JS}.CONSUMER.DELETE.{N.jobs_stream}.generate_tiny",
        ["admin"],
    ),
    ("pull jobs", "publish", f"{JS}.CONSUMER.MSG.NEXT.{N.jobs_stream}.generate_tiny", ["worker", "admin"]),
    ("read dead letters", "publish", f"{JS}.STREAM.MSG.GET.{N.dlq_stream}", ["admin"]),
    (
        "read a result",
        "publish",
        f"{JS}.DIRECT.GET.{N.requests_stream}.{N.request_log('r1')}",
        ["producer", "router", "worker", "admin"],
    ),
    (
        "watch the registry",
        "publish",
        f"{JS}.CONSUMER.CREATE.KV_{N.registry_bucket}.x.$KV.{N.registry_bucket}.i.*",
        ["router", "admin"],
    ),
    ("another namespace's jobs", "publish", Names("other").jobs("generate", "tiny"), []),
    ("hear cancels", "subscribe", N.cancel_all, ["worker", "admin"]),
    ("hear load reports", "subscribe", N.load_all, ["router", "admin"]),
    ("serve control verbs", "subscribe", N.model_control("tiny", "sleep"), ["worker", "admin"]),
    ("hear advisories", "subscribe", N.max_deliveries_advisory("generate", "tiny"), ["worker"]),
    ("read another identity's inbox", "subscribe", "_INBOX.bob.x.y", []),
    ("read every inbox", "subscribe", "_INBOX.>", []),
    ("read its own inbox", "subscribe", "_INBOX.alice.x.y", ["producer", "router", "worker", "admin"]),
    # the OpenAI files and batches are the router's (a gateway and its batch runners)
    ("queue a batch", "publish", N.batch_queue("batch_1"), ["router", "admin"]),
    (
        "write a batch's state",
        "publish",
        f"$KV.{N.batches_bucket}.{N.batch_key('batch_1')}",
        ["router", "admin"],
    ),
    ("put a file", "publish", f"$O.{N.files_store}.M.abc", ["router", "admin"]),
    (
        "take a batch",
        "publish",
        f"{JS}.CONSUMER.MSG.NEXT.{N.batch_queue_stream}.{N.BATCH_RUNNERS}",
        ["router", "admin"],
    ),
    (
        "hold a batch",
        "publish",
        f"$JS.ACK.{N.batch_queue_stream}.batch-runners.1.2.3.4.5",
        ["router", "admin"],
    ),
    ("hear a line's result", "subscribe", N.request_log("batch-1-1"), ["router", "admin"]),
    ("make the files store", "publish", f"{JS}.STREAM.CREATE.OBJ_{N.files_store}", ["router", "admin"]),
    ("delete the batch queue", "publish", f"{JS}.STREAM.DELETE.{N.batch_queue_stream}", ["admin"]),
    ("rescale the batch states", "publish", f"{JS}.STREAM.UPDATE.KV_{N.batches_bucket}", ["worker", "admin"]),
]


@pytest.mark.parametrize("what, op, subject, roles", MAY, ids=[m[0] for m in MAY])
def test_each_role_may_only_what_its_paths_need(what, op, subject, roles):
    assert roles_allowed(op, subject, N, identity="alice") == roles, what


def test_every_identity_receives_only_under_its_own_prefix():
    assert inbox_prefix(None) == "_INBOX"
    assert inbox_prefix("alice") == "_INBOX.alice"
    assert inbox_prefix("a.b") == "_INBOX.a_2Eb"  # a dot would make another identity's prefix a prefix


@pytest.mark.parametrize(
    "op, subject, says",
    [
        ("publish", N.model_control("tiny", "sleep"), "that needs admin credentials"),
        ("publish", f"{JS}.STREAM.CREATE.{N.jobs_stream}".lower(), "that needs worker or admin credentials"),
        ("publish", N.control("status"), "that needs router or admin credentials"),
        ("subscribe", "_INBOX.bob.x", "only under its own inbox prefix"),
        ("publish", "orders.new", "no jetllm role may"),
    ],
)
def test_a_refusal_names_the_subject_the_identity_and_who_may(op, subject, says):
    text = refusal_message(op, subject, "user 'alice'")
    assert text.startswith(f"not permitted: user 'alice' may not {op} to {subject}: ") and says in text


def test_the_servers_refusal_text_is_parsed_as_nats_py_reports_it():
    assert parse_refusal('nats: permissions violation for publish to "$js.api.info"') == (
        "publish",
        "$js.api.info",
    )
    assert parse_refusal('nats: permissions violation for subscription to "q" using queue "g"') == (
        "subscribe",
        "q",
    )
    assert parse_refusal("nats: 'Authorization Violation'") is None


def test_the_shipped_accounts_config_is_what_the_code_generates():
    """infra/nats/accounts.conf cannot drift from the subjects the code uses; renew it with
    `jetllm nats-config --write infra/nats/accounts.conf`."""
    shipped = (ROOT / "infra" / "nats" / "accounts.conf").read_text()
    assert shipped == accounts_config(["default"], default_users())


def test_nats_server_accepts_the_shipped_secured_config_given_the_passwords():
    env = {**os.environ, **{u.password_variable: "x" for u in default_users()}}
    conf = ROOT / "infra" / "nats" / "secured.conf"
    ok = subprocess.run([find_binary(), "-t", "-c", str(conf)], env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    missing = {k: v for k, v in env.items() if k != "JETLLM_ADMIN_PASSWORD"}
    bad = subprocess.run([find_binary(), "-t", "-c", str(conf)], env=missing, capture_output=True, text=True)
    assert bad.returncode != 0 and "JETLLM_ADMIN_PASSWORD" in bad.stdout + bad.stderr


def test_config_users_are_checked_and_named_by_role():
    assert parse_user("producer:alice") == User("producer", name="alice")
    assert User("worker", name="gpu-1").password_variable == "JETLLM_GPU_1_PASSWORD"
    for spec in ("alice", "chef:alice", "producer:a.b", "producer:"):
        with pytest.raises(ValueError):
            parse_user(spec)
    with pytest.raises(ValueError, match="nkey"):
        parse_user("worker:not-a-key", nkey=True)
    with pytest.raises(ValueError, match="its own name"):
        accounts_config(["default"], [User("producer", name="a"), User("admin", name="a")])


SETTINGS = [
    ({"NATS_CREDS": "x.creds", "NATS_USER": "a", "NATS_PASSWORD": "p"}, "NATS_CREDS and NATS_USER"),
    ({"NATS_USER": "a"}, "NATS_USER and NATS_PASSWORD go together"),
    ({"NATS_CERT": __file__}, "NATS_CERT and NATS_KEY together"),
    ({"NATS_CA": "/nonexistent/ca.pem"}, "NATS_CA=/nonexistent/ca.pem: no such file"),
    ({"NATS_NKEY": "/nonexistent/seed"}, "NATS_NKEY=/nonexistent/seed: no such file"),
]


@pytest.mark.parametrize("env, says", SETTINGS, ids=[s[1] for s in SETTINGS])
def test_settings_that_cannot_be_meant_are_refused_naming_the_variable(env, says):
    with pytest.raises(NatsSettingsError, match=says):
        Security.from_env(env).check(["nats://127.0.0.1:4222"])


def test_credentials_given_twice_are_refused():
    with pytest.raises(NatsSettingsError, match="both in the URL and in NATS_USER"):
        Security.from_env({"NATS_USER": "a", "NATS_PASSWORD": "p"}).check(["nats://b:q@h:4222"])


def test_require_tls_refuses_a_plain_url_and_takes_a_tls_one():
    sec = Security.from_env({"JETLLM_REQUIRE_TLS": "1"})
    with pytest.raises(InsecureConnection, match=r"nats://\*\*\*@h:4222 is not a TLS URL: use tls://"):
        sec.check(["tls://h:4221", "nats://u:secret@h:4222"])
    sec.check(["tls://h:4222", "tls://h2:4222"])


def test_the_password_is_in_no_representation():
    sec = Security.from_env({"NATS_USER": "alice", "NATS_PASSWORD": "hunter2-secret"})
    assert "hunter2" not in repr(sec) and "hunter2" not in str(sec)
    assert redact("nats://alice:hunter2@h:4222,tls://b:c@h2") == "nats://***@h:4222,tls://***@h2"
