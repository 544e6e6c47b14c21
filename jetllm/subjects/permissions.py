"""What each kind of identity may publish and subscribe to in one namespace, built from `names`.

The server's configuration (`jetllm nats-config`, infra/nats/secured.conf) and the errors jetllm
shows when the server refuses something both come from `permissions()`, so the two cannot drift
from the subjects the code uses. Four access roles, each allowed only what its paths need:

- **producer**: submit jobs (shared or directed to one instance, whose registry record it reads
  first, or to the routing queue) and cancel them (live and durably: `cancelled.<request>`, not the request log, which only
  workers write), read its own frames and the request log, ping a worker it waits for, nak the job
  of a worker that died, put large embeddings in their store;
- **router**: a producer that also reads the fleet (registry, status, load reports, KV-cache
  events, traces) and asks instances for KV-cache snapshots; `jetllm router`: makes the routing
  queue, takes its jobs, places them and traces each placement; and the identity of a gateway with
  batch runners: the OpenAI files and batches (files store, batch states, batch queue and its
  runners' consumer), and the request log's records as they are written (`req.*`);
- **worker**: pull and settle jobs, write the request log, dead letters, traces, its registry
  record, load reports and KV-cache events; read adapters and embeddings; answer control verbs;
  publish prefill jobs and KV blocks, and read them (prefill and decode workers); hear jobs
  directed to it, and move directed jobs to the shared queues (its own when it stops, those of a
  dead instance when it sweeps);
- **admin**: everything in the namespace (control verbs, LoRA desired state and files, dead
  letters, stream management).

Each identity receives only under its own inbox prefix (`inbox_prefix`), so no producer can read
another producer's frames; a worker may publish to every inbox, which is where frames go.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .names import PREFIX, Names, encode_token

ACCESS_ROLES = ("producer", "router", "worker", "admin")
"""From least to most allowed (worker and router are not comparable); errors name the first that fits."""

INBOX = "_INBOX"
API = "$JS.API"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responses: bool = True
    """May answer requests it received (publish once to their reply subject): control verbs for a
    worker, a worker's resume question for a producer, flow control of ordered consumers for all."""


def check_access_role(role: str) -> str:
    if role not in ACCESS_ROLES:
        raise ValueError(f"access role must be one of {', '.join(ACCESS_ROLES)}, got {role!r}")
    return role


def inbox_prefix(identity: str | None) -> str:
    """Where an identity receives replies and frames: `_INBOX.<identity>` (nats-py's plain `_INBOX`
    for a connection without one). Client and server both take it from here."""
    return INBOX if not identity else f"{INBOX}.{encode_token(identity)}"


def _stream(name: str, *verbs: str) -> list[str]:
    return [f"{API}.STREAM.{verb}.{name}" for verb in verbs]


def _direct(name: str) -> list[str]:
    return [f"{API}.DIRECT.GET.{name}", f"{API}.DIRECT.GET.{name}.>"]


def _reader(name: str) -> list[str]:
    """Ephemeral and ordered consumers of a stream (watches, replays, object reads)."""
    return [
        f"{API}.CONSUMER.CREATE.{name}",
        f"{API}.CONSUMER.CREATE.{name}.>",
        f"{API}.CONSUMER.INFO.{name}.*",
        f"{API}.CONSUMER.DELETE.{name}.*",
    ]


def _kv_reader(bucket: str) -> list[str]:
    """Reading a KV bucket: a key (direct or not, as the bucket allows), watches and listings."""
    name = _kv(bucket)
    return [*_stream(name, "MSG.GET"), *_direct(name), *_reader(name)]


def _kv(bucket: str) -> str:
    return f"KV_{bucket}"


def _obj(store: str) -> str:
    return f"OBJ_{store}"


def plain_streams(names: Names) -> list[str]:
    """The namespace's streams that are neither KV buckets nor object stores (workers create them)."""
    return [
        names.jobs_stream,
        names.dlq_stream,
        names.requests_stream,
        names.cancels_stream,
        names.kv_events_stream,
        names.traces_stream,
    ]


def batch_streams(names: Names) -> list[str]:
    """The OpenAI files and batches: the files store, the batch states and the batch queue (the
    gateway and its batch runners make them; workers only rescale them)."""
    return [_obj(names.files_store), _kv(names.batches_bucket), names.batch_queue_stream]


def part_streams(names: Names) -> list[str]:
    """Streams made by the part of the fleet that uses them, not by the first worker: the KV
    blocks' (prefill workers) and the routing queue (routers)."""
    return [names.kv_blocks_stream, names.routing_stream]


def streams(names: Names) -> list[str]:
    """Every stream of the namespace, buckets and object stores included."""
    return [
        *plain_streams(names),
        *part_streams(names),
        _kv(names.registry_bucket),
        _kv(names.lora_bucket),
        _obj(names.adapters_store),
        _obj(names.embeds_store),
        *batch_streams(names),
    ]


def _producer(n: Names, inbox: str) -> tuple[list[str], list[str]]:
    embeds = _obj(n.embeds_store)
    registry = _kv(n.registry_bucket)
    pub = [
        n.jobs_all,
        n.routing_all,  # jobs for the router fleet to place (Client(via_routers=True))
        n.cancel_all,
        n.cancelled_all,  # durable cancels; the request log itself is the workers' (docs/security.md)
        n.any_instance_control("ping"),
        f"$JS.ACK.{n.jobs_stream}.>",  # -NAK the job of a worker that died
        f"$O.{n.embeds_store}.>",
        f"{API}.INFO",
        *(f"{API}.STREAM.INFO.{s}" for s in streams(n)),
        *_direct(n.requests_stream),
        *_reader(n.requests_stream),
        *_stream(embeds, "CREATE", "PURGE", "MSG.GET"),
        *_direct(embeds),
        *_reader(embeds),
        *_stream(registry, "MSG.GET"),  # is the instance a directed job names alive?
        *_direct(registry),
    ]
    return pub, [f"{inbox}.>"]


def _router(n: Names, inbox: str) -> tuple[list[str], list[str]]:
    pub, sub = _producer(n, inbox)
    pub += [
        n.control("status"),
        n.any_instance_control("status"),
        n.any_instance_control("kv-resync"),
        n.any_model_control("kv-resync"),
        *_kv_reader(n.registry_bucket),
        *_stream(n.kv_events_stream, "MSG.GET"),
        *_direct(n.kv_events_stream),
        *_reader(n.kv_events_stream),
        *_reader(n.traces_stream),
    ]
    sub += [n.load_all, n.routed_all]
    pub += [n.routed_all]  # where it sent a prompt, for the other routers
    pub += _routing_queue(n)
    pub += _batch_plane(n)
    # a batch runner hears its lines' results as they are written: no more than a producer may
    # read from the request log's stream already (docs/security.md, "A router")
    sub += [n.request_log_all]
    return pub, sub


def _routing_queue(n: Names) -> list[str]:
    """`jetllm router`: make the routing queue, take jobs through the routers' consumers and ack
    them; and a gateway's `--max-queue`, which reads how many jobs wait on the shared consumers."""
    routing = n.routing_stream
    return [
        n.trace_all,  # each placement is a hop of the request's trace
        *_stream(routing, "CREATE", "UPDATE"),
        f"$JS.ACK.{routing}.>",
        f"{API}.CONSUMER.DURABLE.CREATE.{routing}.*",
        f"{API}.CONSUMER.INFO.{routing}.*",
        f"{API}.CONSUMER.MSG.NEXT.{routing}.*",
        f"{API}.CONSUMER.INFO.{n.jobs_stream}.*",
    ]


def _batch_plane(n: Names) -> list[str]:
    """A gateway's OpenAI files and batches and its batch runners: make the files store, the batch
    states and the batch queue; read and write files and states; queue batches, and take them
    through the one runners' consumer."""
    files, states, queue = batch_streams(n)
    runners = n.BATCH_RUNNERS
    return [
        f"$O.{n.files_store}.>",
        f"$KV.{n.batches_bucket}.>",
        n.batch_queue_all,
        f"$JS.ACK.{queue}.>",
        f"{API}.STREAM.NAMES",  # nats-py finds an object's stream by subject before reading its chunks
        *_stream(files, "CREATE", "PURGE", "MSG.GET"),  # PURGE: an object's chunks, on overwrite and delete
        *_direct(files),
        *_reader(files),
        *_stream(states, "CREATE", "MSG.GET"),
        *_direct(states),
        *_reader(states),
        *_stream(queue, "CREATE"),
        f"{API}.CONSUMER.CREATE.{queue}.{runners}",
        f"{API}.CONSUMER.CREATE.{queue}.{runners}.>",
        f"{API}.CONSUMER.DURABLE.CREATE.{queue}.{runners}",
        f"{API}.CONSUMER.INFO.{queue}.{runners}",
        f"{API}.CONSUMER.MSG.NEXT.{queue}.{runners}",
    ]


def _worker(n: Names, inbox: str) -> tuple[list[str], list[str]]:
    jobs, requests = n.jobs_stream, n.requests_stream
    registry, lora = _kv(n.registry_bucket), _kv(n.lora_bucket)
    adapters, embeds = _obj(n.adapters_store), _obj(n.embeds_store)
    buckets = [s for s in streams(n) if s not in plain_streams(n) + part_streams(n)]
    pub = [
        f"{INBOX}.>",  # frames and resume questions go to the producers' inboxes
        n.request_log_all,
        n.cancel_all,  # tells an older attempt of a request it took over to stop
        n.any_instance_control("ping"),
        n.dlq_all,
        n.trace_all,
        n.load_all,
        n.kv_events_all,
        f"$KV.{n.registry_bucket}.>",
        f"$JS.ACK.{jobs}.>",
        f"{API}.INFO",
        f"{API}.STREAM.NAMES",  # nats-py finds an object's stream by subject before reading its chunks
        *(f"{API}.STREAM.INFO.{s}" for s in streams(n)),
        *(f"{API}.STREAM.{v}.{s}" for s in plain_streams(n) for v in ("CREATE", "UPDATE")),
        *(f"{API}.STREAM.UPDATE.{s}" for s in buckets),  # `--replicas` rescales the buckets
        *_stream(registry, "CREATE"),
        *_stream(lora, "CREATE"),
        f"{API}.CONSUMER.CREATE.{jobs}.>",
        f"{API}.CONSUMER.DURABLE.CREATE.{jobs}.*",
        f"{API}.CONSUMER.INFO.{jobs}.*",
        f"{API}.CONSUMER.MSG.NEXT.{jobs}.*",
        *_stream(jobs, "MSG.GET", "MSG.DELETE"),
        *_direct(requests),
        *_reader(requests),
        *_direct(n.cancels_stream),  # a job cancelled while queued is dropped unrun
        *_stream(n.kv_events_stream, "MSG.GET"),
        *_stream(registry, "MSG.GET"),  # the sweep reads an instance's record
        *_direct(registry),
        *_kv_reader(n.lora_bucket),
        *_stream(adapters, "MSG.GET"),
        *_direct(adapters),
        *_reader(adapters),
        *_stream(embeds, "MSG.GET"),
        *_direct(embeds),
        # prefill/decode: prefill jobs, and the KV blocks' stream (created by prefill workers)
        n.jobs_of_role("prefill"),
        n.shared_jobs_all,  # directed jobs moved to the shared queues
        n.kv_blocks_all,
        n.kv_live_all,  # blocks sent straight to the decode worker, stored nowhere
        n.kv_received_all,  # a decode worker's receipts pace the prefill worker's publishing
        *_stream(n.kv_blocks_stream, "CREATE", "UPDATE", "PURGE"),
        *_direct(n.kv_blocks_stream),
    ]
    sub = [
        f"{inbox}.>",
        n.kv_blocks_all,  # a decode worker receives the blocks as they are published
        n.kv_live_all,
        n.kv_received_all,  # and a prefill worker the decode worker's receipts
        n.directed_jobs_all,  # a directed job's publish tells its instance to pull it
        n.cancel_all,
        n.control("status"),
        n.any_instance_control(),
        n.any_model_control(),
        n.max_deliveries_advisories,
        n.requests_leader_advisory,  # rewrite what a request-log failover dropped
    ]
    return pub, sub


def _admin(n: Names, inbox: str) -> tuple[list[str], list[str]]:
    pub = [
        n.everything,
        f"$KV.{n.registry_bucket}.>",
        f"$KV.{n.lora_bucket}.>",
        f"$O.{n.adapters_store}.>",
        f"$O.{n.embeds_store}.>",
        f"$O.{n.files_store}.>",
        f"$KV.{n.batches_bucket}.>",
        f"$JS.ACK.{n.jobs_stream}.>",
        f"$JS.ACK.{n.batch_queue_stream}.>",
        f"$JS.ACK.{n.routing_stream}.>",
        f"{API}.INFO",
        f"{API}.STREAM.NAMES",
    ]
    for s in streams(n):
        pub += [
            f"{API}.STREAM.*.{s}",
            f"{API}.STREAM.MSG.*.{s}",
            *_direct(s),
            f"{API}.CONSUMER.*.{s}",
            f"{API}.CONSUMER.*.{s}.>",
            f"{API}.CONSUMER.DURABLE.CREATE.{s}.*",
            f"{API}.CONSUMER.MSG.NEXT.{s}.*",
        ]
    return pub, [f"{inbox}.>", n.everything]


_BUILDERS = {"producer": _producer, "router": _router, "worker": _worker, "admin": _admin}


def permissions(role: str, names: Names, identity: str | None) -> Permissions:
    """The publish and subscribe allow lists of an identity of `role` in `names`' namespace."""
    pub, sub = _BUILDERS[check_access_role(role)](names, inbox_prefix(identity))
    return Permissions(publish=tuple(dict.fromkeys(pub)), subscribe=tuple(dict.fromkeys(sub)))


def matches(pattern: str, subject: str, *, ignore_case: bool = False) -> bool:
    """NATS subject matching: `*` is one token, a final `>` one or more."""
    if ignore_case:
        pattern, subject = pattern.lower(), subject.lower()
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def roles_allowed(op: str, subject: str, names: Names, identity: str | None = None) -> list[str]:
    """The access roles that may `op` ("publish" or "subscribe") `subject`, least allowed first.
    Case is ignored: nats-py reports refused subjects lower-cased."""
    found = []
    for role in ACCESS_ROLES:
        perms = permissions(role, names, identity)
        allowed = perms.publish if op == "publish" else perms.subscribe
        if any(matches(p, subject, ignore_case=True) for p in allowed):
            found.append(role)
    return found


_KINDS = tuple(s.rsplit("_", 1)[-1] for s in streams(Names("x")))
_STREAM_TOKEN = re.compile(rf"(?:KV_|OBJ_)?JETLLM_([A-Z0-9_]+?)_(?:{'|'.join(_KINDS)})", re.IGNORECASE)


def namespace_of(subject: str) -> str | None:
    """The jetllm namespace a subject belongs to (its own subjects, or its streams' API, bucket and
    object subjects), None for anything else. Namespaces have no `_`, so the upper-case form in
    stream names reads back exactly."""
    tokens = subject.split(".")
    if len(tokens) > 2 and tokens[0].lower() == PREFIX:
        return tokens[1].lower()
    for token in tokens:
        m = _STREAM_TOKEN.fullmatch(token)
        if m:
            return m.group(1).lower().replace("_", "-")
    return None
