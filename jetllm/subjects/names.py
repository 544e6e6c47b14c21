"""Every subject, stream, consumer and bucket name jetllm uses, built here and nowhere else.

Subject tree (one namespace `<ns>` per deployment):

    jetllm.<ns>.jobs.<role>.<model>          work-queue stream, one shared consumer per (role, model)
    jetllm.<ns>.jobs.<role>.<model>.i.<inst> directed jobs: one instance's own queue (its own consumer)
    jetllm.<ns>.jobs.<role>.<model>.<more>   reserved: lanes (do not overlap the above)
    jetllm.<ns>.route.<role>.<model>         jobs for a router fleet to place (work-queue stream)
    jetllm.<ns>.dlq.<role>.<model>           dead letters (limits stream)
    jetllm.<ns>.req.<request>                the request log: progress and result (limits stream)
    jetllm.<ns>.cancelled.<request>          a producer's durable cancel (limits stream of its own)
    jetllm.<ns>.cancel.<request>             cancel a request, wherever it runs (core NATS)
    jetllm.<ns>.ctl.<verb>                   fleet-wide control, every worker answers (core NATS)
    jetllm.<ns>.ctl.i.<instance>.<verb>      one instance's control subjects (core NATS)
    jetllm.<ns>.ctl.m.<model>.<verb>         every instance serving a model answers (core NATS)
    jetllm.<ns>.load.<model>.<instance>      load reports, about once a second (core NATS)
    jetllm.<ns>.routed.<role>.<model>        where routers sent prompts, for each other (core NATS)
    jetllm.<ns>.kv.<model>.<instance>        KV-cache events (limits stream, replayable)
    jetllm.<ns>.trace.<request>              per-hop timing records of a request (limits stream)
    jetllm.<ns>.kvblocks.<transfer>          one prompt's KV blocks, prefill to decode (memory stream, TTL)
    jetllm.<ns>.batchq.<batch>               a batch to run, taken by one batch runner (work-queue stream)

KV buckets and object stores: `<NS>_REGISTRY` (instance records `i.<instance>`, model cards
`m.<model>`), `<NS>_LORA` (desired adapters per model), `<NS>_ADAPTERS` (adapter files), `<NS>_EMBEDS` (prompt embeddings too big for a job message), `<NS>_FILES` (files of the OpenAI
files API), `<NS>_BATCHES` (the state of each batch, `b.<batch>`).

Model names and request ids are not subject tokens (`Qwen/Qwen3-0.6B` holds `/` and `.`), so
they pass through `encode_token`, a reversible escaping into `[A-Za-z0-9-_]`.
"""

from __future__ import annotations

import re

PREFIX = "jetllm"
_UNSAFE = re.compile(r"[^A-Za-z0-9-]")
_TOKEN = re.compile(r"^(?:[A-Za-z0-9-]|_[0-9A-F]{2})+$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
_TRANSFER = re.compile(r"^[0-9a-f]{16,64}$")


def _transfer(transfer_id: str) -> str:
    """A transfer id as a subject token: a decode worker's uuid4 hex, nothing else."""
    if not _TRANSFER.match(transfer_id):
        raise ValueError(f"transfer id {transfer_id!r} is not 16-64 lowercase hex characters")
    return transfer_id


ROLES = ("generate",)
"""The job queues producers may use: those with workers. Queues are named by what the job asks
for, so the scheme has room for more (a prefill or encode queue of a disaggregated fleet); a role
is listed here only once workers consume it, as a job on a queue nobody serves would wait unseen."""


SHARD_QUEUE = "shard"
"""The queue of shard jobs (schemas/shard.py): `jetllm.<ns>.jobs.shard.<model>`, pulled by the
generate workers of the model beside their own queue. Not in ROLES: no producer sends a single
request there."""


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(
            f"role {role!r} has no workers; jobs can go to: {', '.join(ROLES)} (leave `role` at its default)"
        )
    return role


def encode_token(value: str) -> str:
    """Escape any string into one subject token that is also a valid stream/consumer/KV name.

    Letters, digits and `-` stay; every other byte of the UTF-8 form becomes `_XX` (hex).
    """
    if not value:
        raise ValueError("cannot encode an empty name")
    return _UNSAFE.sub(_escape, value)


def _escape(m: re.Match[str]) -> str:
    return "".join(f"_{b:02X}" for b in m.group().encode())


def decode_token(token: str) -> str:
    if not _TOKEN.fullmatch(token):
        raise ValueError(f"not an encoded token: {token!r}")
    raw = bytearray()
    i = 0
    while i < len(token):
        if token[i] == "_":
            raw.append(int(token[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.extend(token[i].encode())
            i += 1
    return raw.decode()


def check_name(kind: str, value: str) -> str:
    if not _NAME.fullmatch(value):
        raise ValueError(f"{kind} must match {_NAME.pattern}, got {value!r}")
    return value


def is_safe_reply_subject(subject: str) -> bool:
    """Whether a worker may publish frames to this subject on a job's say-so.

    A job names its own reply subject, so it must not point the worker at the JetStream API
    (`$JS.API...`), system subjects, or jetllm's own subjects (jobs, control, cancel).
    """
    if not subject or len(subject) > 256 or subject.startswith(("$", f"{PREFIX}.")):
        return False
    tokens = subject.split(".")
    return all(t and t not in ("*", ">") and not any(c.isspace() for c in t) for t in tokens)


FRAME_BATCH_TOKEN = "batch"
"""Last token of a producer's batch subject, beside its per-request reply subjects (which are hex)."""


def frame_batch_subject(reply_to: str) -> str:
    """Where a producer reads batched frames: its reply subject's sibling `<prefix>.batch`."""
    return f"{reply_to.rpartition('.')[0]}.{FRAME_BATCH_TOKEN}"


class Names:
    """The names of one namespace."""

    def __init__(self, namespace: str = "default") -> None:
        self.namespace = check_name("namespace", namespace)
        self._root = f"{PREFIX}.{namespace}"
        upper = namespace.upper().replace("-", "_")
        self.jobs_stream = f"JETLLM_{upper}_JOBS"
        self.dlq_stream = f"JETLLM_{upper}_DLQ"
        self.requests_stream = f"JETLLM_{upper}_REQUESTS"
        self.cancels_stream = f"JETLLM_{upper}_CANCELS"
        self.kv_events_stream = f"JETLLM_{upper}_KV"
        self.traces_stream = f"JETLLM_{upper}_TRACES"
        self.registry_bucket = f"JETLLM_{upper}_REGISTRY"
        self.lora_bucket = f"JETLLM_{upper}_LORA"
        self.adapters_store = f"JETLLM_{upper}_ADAPTERS"
        self.embeds_store = f"JETLLM_{upper}_EMBEDS"
        self.kv_blocks_stream = f"JETLLM_{upper}_KVBLOCKS"
        self.files_store = f"JETLLM_{upper}_FILES"
        self.batches_bucket = f"JETLLM_{upper}_BATCHES"
        self.batch_queue_stream = f"JETLLM_{upper}_BATCHQ"
        self.routing_stream = f"JETLLM_{upper}_ROUTE"
        self._advisories = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.jobs_stream}"

    # jobs
    def jobs(self, role: str, model: str) -> str:
        return f"{self._root}.jobs.{check_name('role', role)}.{encode_token(model)}"

    @property
    def jobs_all(self) -> str:
        return f"{self._root}.jobs.>"

    def jobs_of_role(self, role: str) -> str:
        """Every model's queue of one role (decode workers publish prefill jobs)."""
        return f"{self._root}.jobs.{check_name('role', role)}.*"

    def consumer(self, role: str, model: str) -> str:
        return f"{check_name('role', role)}_{encode_token(model)}"

    def directed_jobs(self, role: str, model: str, instance: str) -> str:
        """Jobs addressed to one instance: below its shared queue's subject, so the shared
        consumer (filtered on the exact queue subject) never sees them."""
        return f"{self.jobs(role, model)}.i.{encode_token(instance)}"

    def directed_consumer(self, role: str, model: str, instance: str) -> str:
        return f"{self.consumer(role, model)}_i_{encode_token(instance)}"

    @property
    def shared_jobs_all(self) -> str:
        """Every shared queue (never a directed one): a pattern, for permissions."""
        return f"{self._root}.jobs.*.*"

    @property
    def directed_jobs_all(self) -> str:
        """Every instance's directed queue: a pattern, for the sweep and permissions."""
        return f"{self._root}.jobs.*.*.i.*"

    def parse_directed(self, subject: str) -> tuple[str, str, str] | None:
        """(role, model, instance) of a directed job subject; None for any other subject, and for
        one whose role token is not a role name (producers may publish anywhere under `jobs.>`:
        such a job has no shared queue to move to, and must not stop a sweep)."""
        parts = subject.split(".")
        if len(parts) != 7 or ".".join(parts[:3]) != f"{self._root}.jobs" or parts[5] != "i":
            return None
        if not _NAME.fullmatch(parts[3]):
            return None
        try:
            return parts[3], decode_token(parts[4]), decode_token(parts[6])
        except ValueError:
            return None

    # the routing queue: jobs that `jetllm router` instances place (docs/routing.md)
    def routing(self, role: str, model: str) -> str:
        """Its own stream, so the placed job can keep its request id as Nats-Msg-Id in the jobs
        stream (one stream would take the republished job for a duplicate of the routed one)."""
        return f"{self._root}.route.{check_name('role', role)}.{encode_token(model)}"

    @property
    def routing_all(self) -> str:
        return f"{self._root}.route.>"

    def routing_consumer(self, role: str, model: str) -> str:
        """One durable consumer per (role, model), shared by every router: each job goes to one."""
        return f"router_{self.consumer(role, model)}"

    def parse_jobs(self, subject: str) -> tuple[str, str]:
        """(role, model) of a job subject."""
        parts = subject.split(".")
        if len(parts) < 5 or ".".join(parts[:3]) != f"{self._root}.jobs":
            raise ValueError(f"not a job subject of namespace {self.namespace!r}: {subject!r}")
        return parts[3], decode_token(parts[4])

    # prefill/decode handoff
    def kv_blocks(self, transfer_id: str) -> str:
        return f"{self._root}.kvblocks.{_transfer(transfer_id)}"

    @property
    def kv_blocks_all(self) -> str:
        return f"{self._root}.kvblocks.*"

    def kv_live(self, transfer_id: str) -> str:
        """Blocks sent straight to the decode worker: no stream holds this subject."""
        return f"{self._root}.kvlive.{_transfer(transfer_id)}"

    @property
    def kv_live_all(self) -> str:
        return f"{self._root}.kvlive.*"

    def kv_received(self, transfer_id: str) -> str:
        """Where the decode worker says how much of a transfer it has received (flow control)."""
        return f"{self._root}.kvrecv.{_transfer(transfer_id)}"

    @property
    def kv_received_all(self) -> str:
        return f"{self._root}.kvrecv.*"

    # batches of the OpenAI batch API: the queue runners take them from, and their state
    def batch_queue(self, batch_id: str) -> str:
        return f"{self._root}.batchq.{encode_token(batch_id)}"

    @property
    def batch_queue_all(self) -> str:
        return f"{self._root}.batchq.*"

    BATCH_RUNNERS = "batch-runners"
    """The one durable consumer every batch runner pulls from."""

    @staticmethod
    def batch_key(batch_id: str) -> str:
        return f"b.{encode_token(batch_id)}"

    # dead letters
    def dlq(self, role: str, model: str) -> str:
        return f"{self._root}.dlq.{check_name('role', role)}.{encode_token(model)}"

    @property
    def dlq_all(self) -> str:
        return f"{self._root}.dlq.>"

    # request log
    def request_log(self, request_id: str) -> str:
        return f"{self._root}.req.{encode_token(request_id)}"

    @property
    def request_log_all(self) -> str:
        return f"{self._root}.req.*"

    # durable cancels: written by producers, apart from the request log only workers write
    def cancelled(self, request_id: str) -> str:
        return f"{self._root}.cancelled.{encode_token(request_id)}"

    @property
    def cancelled_all(self) -> str:
        return f"{self._root}.cancelled.*"

    # control
    def cancel(self, request_id: str) -> str:
        return f"{self._root}.cancel.{encode_token(request_id)}"

    @property
    def cancel_all(self) -> str:
        return f"{self._root}.cancel.*"

    def control(self, verb: str) -> str:
        return f"{self._root}.ctl.{check_name('verb', verb)}"

    def instance_control(self, instance: str, verb: str) -> str:
        return f"{self._root}.ctl.i.{encode_token(instance)}.{check_name('verb', verb)}"

    def max_deliveries_advisory(self, role: str, model: str) -> str:
        """Where JetStream announces that a job of (role, model) ran out of deliveries."""
        return f"{self._advisories}.{self.consumer(role, model)}"

    def consumer_max_deliveries_advisory(self, consumer: str) -> str:
        """The same, for a consumer named by `consumer` or `directed_consumer`."""
        return f"{self._advisories}.{consumer}"

    @property
    def max_deliveries_advisories(self) -> str:
        return f"{self._advisories}.*"

    def any_instance_control(self, verb: str | None = None) -> str:
        """`verb` (None: any verb) on every instance's own subject: a pattern, for permissions."""
        return f"{self._root}.ctl.i.*.{'*' if verb is None else check_name('verb', verb)}"

    def any_model_control(self, verb: str | None = None) -> str:
        return f"{self._root}.ctl.m.*.{'*' if verb is None else check_name('verb', verb)}"

    @property
    def everything(self) -> str:
        """Every subject of the namespace: a pattern, for permissions."""
        return f"{self._root}.>"

    @property
    def requests_leader_advisory(self) -> str:
        """Where JetStream announces a new leader of the request log's stream (a cluster failover)."""
        return f"$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED.{self.requests_stream}"

    def model_control(self, model: str, verb: str) -> str:
        return f"{self._root}.ctl.m.{encode_token(model)}.{check_name('verb', verb)}"

    # registry (keys of the registry bucket)
    @staticmethod
    def instance_key(instance: str) -> str:
        return f"i.{encode_token(instance)}"

    @staticmethod
    def model_card_key(model: str) -> str:
        return f"m.{encode_token(model)}"

    # load reports, KV-cache events, traces
    def routed(self, role: str, model: str) -> str:
        return f"{self._root}.routed.{check_name('role', role)}.{encode_token(model)}"

    @property
    def routed_all(self) -> str:
        return f"{self._root}.routed.>"

    def load(self, model: str, instance: str) -> str:
        return f"{self._root}.load.{encode_token(model)}.{encode_token(instance)}"

    def load_of(self, model: str) -> str:
        return f"{self._root}.load.{encode_token(model)}.*"

    @property
    def load_all(self) -> str:
        return f"{self._root}.load.>"

    def kv_events(self, model: str, instance: str) -> str:
        return f"{self._root}.kv.{encode_token(model)}.{encode_token(instance)}"

    def kv_events_of(self, model: str) -> str:
        return f"{self._root}.kv.{encode_token(model)}.*"

    @property
    def kv_events_all(self) -> str:
        return f"{self._root}.kv.>"

    def trace(self, request_id: str) -> str:
        return f"{self._root}.trace.{encode_token(request_id)}"

    @property
    def trace_all(self) -> str:
        return f"{self._root}.trace.*"

    # LoRA desired state (keys of the LoRA bucket) and adapter files (names in the adapters store)
    @staticmethod
    def lora_key(model: str, adapter: str) -> str:
        return f"{encode_token(model)}.{encode_token(adapter)}"

    @staticmethod
    def lora_keys_of(model: str) -> str:
        return f"{encode_token(model)}.*"

    @staticmethod
    def adapter_from_key(key: str) -> str:
        return decode_token(key.rsplit(".", 1)[-1])

    @staticmethod
    def adapter_manifest(adapter: str) -> str:
        return f"manifest/{adapter}"

    @staticmethod
    def adapter_file(sha256: str, file: str) -> str:
        return f"sha256/{sha256}/{file}"
