"""Hostile traffic for the fuzz tests: everything a producer or an operator can send a worker.

Pure generation, seeded: the same seed and target give the same messages (a failing run prints
its seed; JETLLM_FUZZ_SEED replays it). Each message is a `Shot`; job shots carry what the
worker must answer, computed with the worker's own decoder (`decode_request`), so the test
checks the worker against the contract rather than against a second copy of it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import msgspec

from jetllm.schemas import ShardJob, SleepRequest
from jetllm.subjects import codec
from jetllm.subjects.names import SHARD_QUEUE, Names, encode_token, is_safe_reply_subject
from jetllm.workers.jobs import RejectedJob, decode_request

JSON_CT = {"Content-Type": "application/json"}
MP_CT = {"Content-Type": "application/msgpack"}

VERBS_INSTANCE_ONLY = ("status", "ping")
"""Served on the instance subject only (the fleet-wide `ctl.status` too)."""
VERBS = (
    "health",
    "reset-prefix-cache",
    "sleep",
    "wake",
    "kv-resync",
    "lora-load",
    "lora-unload",
    "lora-list",
    "tasks",
)
"""Served on the instance and the model subject (ControlServer.add)."""

MAX_TOKENS_RUN = 8
"""A mutated job that still decodes may run only this long, so the barrage stays quick."""


@dataclass
class Target:
    """What the traffic is aimed at."""

    names: Names
    model: str
    instance: str
    vocab: int
    hidden: int
    frames_prefix: str
    """Job reply subjects live under it (`<prefix>.<n>`): the test counts frames there."""
    control_prefix: str
    acks_prefix: str
    lora_dirs: list[str] = field(default_factory=list)
    """Adapter directories on the worker's --lora-dir (broken adapters, for desired-state values)."""
    embeds: list[EmbedsObject] = field(default_factory=list)


@dataclass
class EmbedsObject:
    """An object in the embeddings store, and what a job referencing it should claim."""

    name: str
    sha256: str
    shape: list[int]
    dtype: str


@dataclass
class JobExpect:
    """What the worker owes one job: frames on `reply` (the reply subject its own decoder finds).

    strict: exactly one terminal frame there. Not strict: the bytes do not decode even far enough
    to salvage a reply subject (e.g. invalid UTF-8), so at most one, on a subject named in them.
    """

    reply: str | None
    strict: bool
    candidates: list[str]
    """Not strict: reply subjects under the frames prefix found in the bytes."""
    note: str


@dataclass
class Shot:
    kind: str
    """pub (core NATS publish), raw (hand-made HPUB with a raw header block)."""
    subject: str
    data: bytes
    headers: dict[str, str] | None = None
    reply: str | None = None
    raw_headers: bytes | None = None
    job: JobExpect | None = None
    control: bool = False
    """A control request whose reply the test collects (exactly one expected)."""
    what: str = ""


# -- byte-level mutation -------------------------------------------------------------------------

_BAD_UTF8 = [b"\x96", b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xe2\x82", b"\xf0\x28\x8c\xbc", b"\xc0\xaf"]


def flip_bits(rng: random.Random, data: bytes) -> bytes:
    if not data:
        return bytes([rng.randrange(256)])
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    return bytes(b)


def insert_bytes(rng: random.Random, data: bytes) -> bytes:
    i = rng.randint(0, len(data))
    junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
    return data[:i] + junk + data[i:]


def delete_bytes(rng: random.Random, data: bytes) -> bytes:
    if not data:
        return data
    i = rng.randrange(len(data))
    return data[:i] + data[i + rng.randint(1, 4) :]


def truncate(rng: random.Random, data: bytes) -> bytes:
    return data[: rng.randrange(len(data))] if data else data


def bad_utf8_in_string(rng: random.Random, data: bytes, encoding: str) -> bytes:
    """Invalid UTF-8 inside a string value: msgspec raises UnicodeDecodeError for it, not DecodeError."""
    bad = rng.choice(_BAD_UTF8)
    if encoding == "json":
        quotes = [m.start() for m in re.finditer(rb'"', data)]
        if not quotes:
            return data + bad
        i = rng.choice(quotes) + 1
        return data[:i] + bad + data[i:]
    # msgpack fixstr headers (0xa1..0xbf) with their bytes after them: overwrite one content byte
    spots = [i for i, c in enumerate(data) if 0xA1 <= c <= 0xBF and i + 1 + (c & 0x1F) <= len(data)]
    if not spots:
        return data + bad
    i = rng.choice(spots)
    j = i + 1 + rng.randrange(data[i] & 0x1F)
    return data[:j] + b"\xff" + data[j + 1 :]


def splice(rng: random.Random, data: bytes) -> bytes:
    if len(data) < 4:
        return data * 2
    i, j = sorted(rng.sample(range(len(data)), 2))
    return data[:i] + data[j:] + data[i:j]


BYTE_MUTATIONS = [flip_bits, insert_bytes, delete_bytes, truncate, splice]


# -- values of the wrong kind ----------------------------------------------------------------------


def nested(depth: int, leaf: Any = 0) -> Any:
    out: Any = leaf
    for _ in range(depth):
        out = [out]
    return out


def deep_bytes(depth: int, encoding: str) -> bytes:
    """A value nested `depth` levels deep, built as bytes (encoders refuse such depths)."""
    if encoding == "json":
        return b"[" * depth + b"0" + b"]" * depth
    return b"\x91" * depth + b"\x00"


def odd_value(rng: random.Random) -> Any:
    return rng.choice(
        [
            None,
            True,
            -1,
            0,
            2**63 - 1,
            -(2**63),
            2**64 - 1,
            3.5,
            -0.0,
            1e308,
            float("nan"),
            float("inf"),
            "",
            "x" * rng.randint(1, 300),
            "\u0000",
            "\u202e\u200b",
            "💥" * 50,
            [],
            [1, "a", None],
            {},
            {"a": {"b": [1]}},
            b"\x00\xff",
            nested(rng.randint(2, 50)),
        ]
    )


def hostile_reply(rng: random.Random, prefix: str) -> str:
    """Reply subjects a job must not get frames on (or, for the plain ones, must)."""
    return rng.choice(
        [
            "*",
            ">",
            f"{prefix}.*",
            f"{prefix}.>",
            "$JS.API.STREAM.DELETE.X",
            "$SYS.REQ.SERVER.PING",
            "jetllm.default.ctl.sleep",
            "jetllm.x.jobs.generate.tiny",
            f"{prefix}.a b",
            f"{prefix}.\tx",
            f"{prefix}..x",
            f"{prefix}.",
            "." + prefix,
            f"{prefix}." + "x" * 300,
            "a" * 257,
            f"{prefix}.\u00e9\u00e8",
            f"{prefix}.x\r\ny",
            f"{prefix}.x\x00y",
            "",
            " ",
            f"{prefix}.{'a.' * 60}z",
        ]
    )


# -- the generator ---------------------------------------------------------------------------------


class Generator:
    def __init__(self, seed: int, target: Target) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.t = target
        self.n_jobs = 0
        self.n_controls = 0
        self.n_acks = 0
        self.rids: list[str] = []
        self.msg_ids: list[str] = []
        self.adapter_names = ["fz-a", "fz-b", "fz-c", "broken", "outside"]
        self.stats: dict[str, int] = {}
        self.touched: dict[str, list[str]] = {}
        """Request id -> what else was sent about it (forged log records, cancels): for failure reports."""

    def count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    # jobs

    def _prompt(self) -> dict:
        rng = self.rng
        kind = rng.choice(["tokens"] * 6 + ["text"] * 2 + ["chat"] * 2 + ["embeds", "object"])
        if kind == "tokens":
            return {
                "type": "tokens",
                "token_ids": [rng.randrange(3, min(self.t.vocab, 300)) for _ in range(rng.randint(1, 12))],
            }
        if kind == "text":
            return {
                "type": "text",
                "text": rng.choice(["Hello", "The quick brown fox", "a b c d", "1 2 3", "zz"]),
            }
        if kind == "chat":
            p: dict = {
                "type": "chat",
                "messages": [{"role": "user", "content": rng.choice(["hi", "count", "?"])}],
            }
            if rng.random() < 0.3:
                p["template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
            return p
        if kind == "embeds" or not self.t.embeds:
            rows = rng.randint(1, 3)
            raw = struct.pack(
                f"<{rows * self.t.hidden}f", *(rng.uniform(-0.05, 0.05) for _ in range(rows * self.t.hidden))
            )
            return {"type": "embeds", "dtype": "float32", "shape": [rows, self.t.hidden], "data": raw}
        obj = rng.choice(self.t.embeds)
        p = {
            "type": "embeds",
            "dtype": obj.dtype,
            "shape": list(obj.shape),
            "object": obj.name,
            "sha256": obj.sha256,
        }
        if rng.random() < 0.3:  # lie about it
            lie = rng.choice(["sha", "shape", "dtype", "name"])
            if lie == "sha":
                p["sha256"] = hashlib.sha256(rng.randbytes(8)).hexdigest()
            elif lie == "shape":
                p["shape"] = [rng.choice([1, 2, 7, 10**6]), rng.choice([self.t.hidden, 1, 0])]
            elif lie == "dtype":
                p["dtype"] = rng.choice(["float16", "bfloat16"])
            else:
                p["object"] = rng.choice(["missing", "../x", "a" * 256, "$O.x", "Ω"])
        return p

    def base_job(self) -> tuple[dict, str]:
        rng = self.rng
        i = self.n_jobs
        rid = f"fz{self.seed}-{i}"
        if self.rids and rng.random() < 0.04:
            rid = rng.choice(self.rids)  # a duplicated request id
            self.count("duplicate request id")
        self.rids.append(rid)
        body: dict = {
            "v": 1,
            "request_id": rid,
            "model": self.t.model,
            "prompt": self._prompt(),
            "stop": {"max_tokens": rng.randint(1, 4), "ignore_eos": rng.random() < 0.7},
            "reply_to": f"{self.t.frames_prefix}.{i}",
        }
        if rng.random() < 0.5:
            body["sampling"] = (
                {"temperature": 0}
                if rng.random() < 0.6
                else {
                    "temperature": rng.uniform(0, 2),
                    "top_p": rng.uniform(0.1, 1),
                    "seed": rng.randrange(1000),
                    "n": rng.randint(1, 3),
                }
            )
        if rng.random() < 0.2:
            body["output"] = {"text": rng.random() < 0.5, "logprobs": rng.choice([None, 0, 3])}
        if rng.random() < 0.05:
            body["adapter"] = rng.choice(self.adapter_names)
        if rng.random() < 0.05:
            body["max_migrations"] = rng.randint(0, 3)
        return body, rng.choice(["msgpack"] * 3 + ["json"] * 2)

    def _structural(self, body: dict, enc: str) -> tuple[dict, bytes | None, str]:  # noqa: C901 (one branch per change)
        """A change to the job's structure; returns (body, bytes to use instead of encoding it, label)."""
        rng = self.rng
        how = rng.choice(
            [
                "wrong type",
                "missing",
                "unknown field",
                "deep",
                "huge number",
                "nan",
                "oversized",
                "reply",
                "model",
                "version",
                "request id",
                "prompt swap",
            ]
        )
        b = json.loads(json.dumps(body, default=lambda o: base64.b64encode(o).decode()))
        if isinstance(body["prompt"].get("data"), bytes):
            b["prompt"]["data"] = body["prompt"]["data"]
        paths = [
            ("v",),
            ("request_id",),
            ("model",),
            ("prompt",),
            ("prompt", "type"),
            ("stop",),
            ("stop", "max_tokens"),
            ("reply_to",),
            ("sampling",),
            ("output",),
            ("prompt", "token_ids"),
            ("prompt", "messages"),
            ("prompt", "shape"),
            ("prompt", "data"),
            ("adapter",),
        ]
        if how == "wrong type":
            path = rng.choice(paths)
            _set(b, path, odd_value(rng))
        elif how == "missing":
            key = rng.choice(["v", "request_id", "model", "prompt", "reply_to"])
            b.pop(key, None)
        elif how == "unknown field":
            b[rng.choice(["max_token", "x", "", "prompt_", "🙂"])] = odd_value(rng)
        elif how == "deep":
            depth = rng.choice([100, 900, 5000, 100_000])
            field_ = rng.choice(["template_kwargs", "prompt", "stop", "extra"])
            marker = "__DEEP__"
            if field_ == "template_kwargs":
                b["prompt"] = {
                    "type": "chat",
                    "messages": [{"role": "user", "content": "x"}],
                    "template_kwargs": {"k": marker},
                }
            elif field_ == "extra":
                b["extra"] = marker
            else:
                b[field_] = marker
            data = _encode_loose(b, enc)
            deep = deep_bytes(depth, enc)
            token = codec.encode(marker, enc)  # type: ignore[arg-type]
            return b, data.replace(token, deep, 1), f"deep {field_} {depth}"
        elif how == "huge number":
            path = rng.choice(
                [
                    ("stop", "max_tokens"),
                    ("v",),
                    ("prompt", "token_ids"),
                    ("sampling", "seed"),
                    ("max_migrations",),
                    ("stop", "min_tokens"),
                    ("sampling", "n"),
                ]
            )
            value = rng.choice([2**63 - 1, 2**64 - 1, -(2**63), 10**18, 1e308, -1e308])
            if path == ("prompt", "token_ids"):
                value = [value]
            _set(b, path, value)
            if enc == "json" and rng.random() < 0.5:
                data = _encode_loose(b, enc)
                return (
                    b,
                    data.replace(str(value).encode(), b"9" * rng.choice([20, 400, 5000]), 1),
                    "huge literal",
                )
        elif how == "nan":
            target = rng.choice([("sampling", "temperature"), ("sampling", "top_p"), ("prompt", "data")])
            if target == ("prompt", "data"):
                rows = rng.randint(1, 2)
                b["prompt"] = {
                    "type": "embeds",
                    "dtype": "float32",
                    "shape": [rows, self.t.hidden],
                    "data": b"\x00\x00\xc0\x7f" * rows * self.t.hidden,
                }
            else:
                b.setdefault("sampling", {})
                b["sampling"][target[1]] = rng.choice([float("nan"), float("inf"), -float("inf")])
                if enc == "json":
                    data = _encode_loose(b, enc)
                    return (
                        b,
                        data.replace(b"null", rng.choice([b"NaN", b"Infinity", b"1e999", b"-1e999"]), 1),
                        how,
                    )
        elif how == "oversized":
            size = rng.choice([10_000, 100_000, 300_000, 900_000])
            which = rng.choice(
                ["text", "tokens", "stop", "messages", "request_id", "reply_to", "model", "embeds"]
            )
            if which == "text":
                b["prompt"] = {"type": "text", "text": "word " * (size // 5)}
            elif which == "tokens":
                b["prompt"] = {"type": "tokens", "token_ids": [7] * (size // 2)}
            elif which == "stop":
                b["stop"] = {"max_tokens": 2, "stop": ["s"] * (size // 4)}
            elif which == "messages":
                b["prompt"] = {"type": "chat", "messages": [{"role": "user", "content": "x"}] * (size // 30)}
            elif which == "embeds":
                rows = max(1, size // (4 * self.t.hidden))
                b["prompt"] = {
                    "type": "embeds",
                    "dtype": "float32",
                    "shape": [rows, self.t.hidden],
                    "data": b"\x00" * (rows * self.t.hidden * 4),
                }
            else:
                b[which] = "a" * size
            how = f"oversized {which} {size}"
        elif how == "reply":
            b["reply_to"] = hostile_reply(rng, self.t.frames_prefix)
        elif how == "model":
            b["model"] = rng.choice(["other", "tiny2", "Tiny", "", "a" * 300, "fz-a", self.t.model + " "])
        elif how == "version":
            b["v"] = rng.choice([0, 2, 99, -1, "1", 1.0, None])
        elif how == "request id":
            b["request_id"] = rng.choice(
                ["", "a b", "x" * 201, "é", "$JS.API", "a.b", "*", "\u0000", "a/b=c:d+e"]
            )
        elif how == "prompt swap":
            b["prompt"] = rng.choice(
                [
                    {"type": "tokens", "token_ids": [self.t.vocab + rng.randrange(10**6)]},
                    {"type": "tokens", "token_ids": [-1]},
                    {"type": "chat", "messages": []},
                    {"type": "chat", "messages": [{"role": "", "content": "x"}]},
                    {
                        "type": "chat",
                        "messages": [{"role": "user", "content": "x"}],
                        "template_kwargs": {"chat_template": "{{ 1/0 }}", "messages": 5, "tools": "x"},
                    },
                    {"type": "text", "text": ""},
                    {"type": "embeds", "dtype": "float64", "shape": [1, self.t.hidden], "data": b"\0" * 8},
                    {"type": "embeds", "dtype": "float32", "shape": [1, self.t.hidden, 1], "data": b""},
                    {"type": "embeds", "dtype": "float32", "shape": [2, self.t.hidden], "data": b"\0" * 3},
                    {"type": "embeds", "dtype": "float32", "shape": [0, self.t.hidden], "data": b""},
                    {"type": "embeds", "dtype": "float32", "shape": [1, self.t.hidden]},
                    {
                        "type": "embeds",
                        "dtype": "float32",
                        "shape": [1, self.t.hidden],
                        "object": "x",
                        "data": b"\0",
                    },
                    {"type": "unknown"},
                    {"type": None},
                    {},
                    [],
                    "tokens",
                ]
            )
        return b, None, how

    def job(self) -> Shot:
        """A job for the served model's queue: valid, mutated, or junk (never one that runs long)."""
        for _ in range(20):
            shot = self._job()
            if not decodes_to_long_job(shot.data, shot.headers):
                return shot
            self.stats[f"job: {shot.job.note}"] -= 1  # type: ignore[union-attr]
        body, enc = self.base_job()
        self.n_jobs += 1
        return self._job_shot(
            self.t.names.jobs("generate", self.t.model),
            _encode_loose(body, enc),
            dict(JSON_CT if enc == "json" else MP_CT),
            "valid",
            self.n_jobs - 1,
        )

    def _job(self) -> Shot:
        rng = self.rng
        body, enc = self.base_job()
        i = self.n_jobs
        self.n_jobs += 1
        roll = rng.random()
        if roll < 0.12:
            data, label = _encode_loose(body, enc), "valid"
        elif roll < 0.50:
            data = _encode_loose(body, enc)
            mutation = rng.choice(BYTE_MUTATIONS)
            for _ in range(rng.choice([1, 1, 1, 2, 3])):
                data = mutation(rng, data)
            label = mutation.__name__
        elif roll < 0.60:
            data, label = bad_utf8_in_string(rng, _encode_loose(body, enc), enc), "invalid utf-8"
        elif roll < 0.92:
            b, data_, label = self._structural(body, enc)
            data = data_ if data_ is not None else _encode_loose(b, enc)
        else:
            label = rng.choice(["empty", "random", "null", "array", "string", "int", "json in msgpack"])
            data = {
                "empty": b"",
                "random": rng.randbytes(rng.randint(1, 2000)),
                "null": codec.encode(None, enc),  # type: ignore[arg-type]
                "array": codec.encode([1, 2], enc),
                "string": codec.encode("job", enc),  # type: ignore[arg-type]
                "int": codec.encode(7, enc),
                "json in msgpack": _encode_loose(body, "json"),  # type: ignore[arg-type]
            }[label]
        headers = self._job_headers(enc)
        return self._job_shot(self.t.names.jobs("generate", self.t.model), data, headers, label, i)

    def _job_headers(self, enc: str) -> dict[str, str] | None:
        rng = self.rng
        right = JSON_CT if enc == "json" else MP_CT
        roll = rng.random()
        if roll < 0.70:
            headers: dict[str, str] | None = dict(right)
        elif roll < 0.78:
            headers = None if enc == "msgpack" or rng.random() < 0.5 else {}
        elif roll < 0.86:
            headers = dict(MP_CT if enc == "json" else JSON_CT)  # lying
        else:
            headers = {
                rng.choice(["Content-Type", "content-type", "CONTENT-TYPE"]): rng.choice(
                    [
                        "text/plain",
                        "application/json; charset=latin-1",
                        "APPLICATION/MSGPACK",
                        "",
                        " ",
                        "application/",
                        "application/x-msgpack",
                        "text/json",
                        "application/json;;;",
                        "ä" * 100,
                        "x" * 4000,
                        "*/*",
                    ]
                )
            }
        if headers is not None and rng.random() < 0.05:
            headers["traceparent"] = rng.choice(
                [
                    "00-" + "0" * 32 + "-" + "0" * 16 + "-01",
                    "garbage",
                    "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
                    "x" * 500,
                ]
            )
        if headers is not None and rng.random() < 0.03:
            headers[rng.choice(["Status", "status"])] = rng.choice(["100", "404", "408", "409", "503"])
            self.count("status header")
        if rng.random() < 0.06:
            headers = dict(headers or {})
            if self.msg_ids and rng.random() < 0.5:
                headers["Nats-Msg-Id"] = rng.choice(self.msg_ids)
            else:
                headers["Nats-Msg-Id"] = f"fzmid-{self.seed}-{len(self.msg_ids)}"
                self.msg_ids.append(headers["Nats-Msg-Id"])
        return headers

    def _job_shot(
        self,
        subject: str,
        data: bytes,
        headers: dict[str, str] | None,
        label: str,
        i: int,
        raw_headers: bytes | None = None,
        parsed: dict[str, str] | None = None,
    ) -> Shot:
        self.count(f"job: {label}")
        ack = f"{self.t.acks_prefix}.{self.n_acks}"
        self.n_acks += 1
        expect = expectation(data, parsed if raw_headers is not None else headers, self.t.frames_prefix)
        expect.note = label
        return Shot(
            "raw" if raw_headers is not None else "pub",
            subject,
            data,
            headers,
            ack,
            raw_headers,
            job=expect,
            what=f"job {i} ({self.rids[-1]}): {label}",
        )

    def shard(self) -> Shot:
        """A shard for the served model's shard queue: a few of `base_job`'s bodies as its requests,
        valid, mutated or junk (never one whose requests run long). Whatever it holds, the worker
        settles it and goes on; its requests' frames are not counted (a shard's are detached)."""
        rng = self.rng
        requests = []
        for _ in range(rng.randint(1, 4)):
            body, enc = self.base_job()
            self.n_jobs += 1
            if rng.random() < 0.9:
                body.pop("reply_to", None)
            requests.append(body)
        shard: dict = {
            "v": 1,
            "request_id": f"fz{self.seed}-shard-{self.n_jobs}",
            "model": self.t.model,
            "requests": requests,
            "fresh": rng.random() < 0.5,
        }
        roll = rng.random()
        if roll < 0.3:
            label, data = "valid", _encode_loose(shard, enc)
        elif roll < 0.6:
            how = rng.choice(["unknown field", "version", "model", "requests", "request field", "twice"])
            if how == "unknown field":
                shard["lines"] = 1
            elif how == "version":
                shard["v"] = rng.choice([0, 2, "1", None])
            elif how == "model":
                shard["model"] = rng.choice(["other", "", "a" * 300])
            elif how == "requests":
                shard["requests"] = rng.choice([[], "x", [1, 2], None, [{}], requests * 400])
            elif how == "request field":
                requests[0]["surprise"] = True
            else:
                shard["requests"] = requests + requests
            label, data = f"shard {how}", _encode_loose(shard, enc)
        else:
            data = _encode_loose(shard, enc)
            mutation = rng.choice(BYTE_MUTATIONS)
            data, label = mutation(rng, data), f"shard {mutation.__name__}"
        if _shard_runs_long(data, enc):
            label, data = "valid", _encode_loose({**shard, "requests": requests[:1]}, enc)
            if _shard_runs_long(data, enc):
                data = b""
        self.count(f"shard: {label}")
        return Shot(
            "pub",
            self.t.names.jobs(SHARD_QUEUE, self.t.model),
            data,
            dict(JSON_CT if enc == "json" else MP_CT),
            what=f"shard {shard['request_id']}: {label}",
        )

    def job_elsewhere(self) -> Shot:
        """A job on a queue this worker does not serve: it must never reach it."""
        rng = self.rng
        body, enc = self.base_job()
        i = self.n_jobs
        self.n_jobs += 1
        names = self.t.names
        subject = rng.choice(
            [
                names.jobs("generate", rng.choice(["other", "Tiny", "tiny/x", "a" * 100])),
                names.jobs("prefill", self.t.model),
                names.jobs("encode", self.t.model),
                names.jobs("generate", self.t.model) + ".lane",
                names.jobs("generate", rng.choice(self.adapter_names)),
            ]
        )
        data = _encode_loose(body, enc)
        if rng.random() < 0.5:
            data = rng.choice(BYTE_MUTATIONS)(rng, data)
        self.count("job elsewhere")
        return Shot(
            "pub",
            subject,
            data,
            dict(JSON_CT if enc == "json" else MP_CT),
            job=JobExpect(None, True, [], "elsewhere"),
            what=f"job {i} elsewhere: {subject}",
        )

    def raw_job(self) -> Shot:
        """A job with a hand-made header block (what no well-behaved client library sends)."""
        rng = self.rng
        body, enc = self.base_job()
        i = self.n_jobs
        self.n_jobs += 1
        data = _encode_loose(body, enc) if rng.random() < 0.8 else b""
        ct = b"application/json" if enc == "json" else b"application/msgpack"
        block = rng.choice(
            [
                b"NATS/1.0\r\nContent-Type: " + ct + b"\r\n\r\n",
                b"NATS/1.0\r\nContent-Type: " + ct + b"\xff\xfe\r\n\r\n",
                b"NATS/1.0\r\nContent-Type:\r\n\r\n",
                b"NATS/1.0\r\nContent-Type " + ct + b"\r\n\r\n",
                b"NATS/1.0\r\n\xff\xfe: \x96\r\nContent-Type: " + ct + b"\r\n\r\n",
                b"NATS/1.0 404\r\n\r\n",
                b"NATS/1.0 408 Request Timeout\r\n\r\n",
                b"NATS/1.0 100 Idle Heartbeat\r\nContent-Type: " + ct + b"\r\n\r\n",
                b"NATS/1.0\r\nStatus: 404\r\n\r\n",
                b"NATS/1.0\r\n" + b"X: " + b"y" * 5000 + b"\r\n\r\n",
                b"NATS/1.0\r\n\r\n",
            ]
        )
        parsed = _parse_headers(block)
        return self._job_shot(
            self.t.names.jobs("generate", self.t.model),
            data,
            None,
            "raw headers",
            i,
            raw_headers=block,
            parsed=parsed,
        )

    # cancels

    def cancel(self) -> Shot:
        rng = self.rng
        rid = (
            rng.choice(self.rids)
            if self.rids and rng.random() < 0.8
            else rng.choice(["x", "fz-none", "é", "a" * 300, "_", "*"])
        )
        body: dict = {"v": 1, "request_id": rid}
        if rng.random() < 0.5:
            body["reason"] = rng.choice(["fuzz", "", "x" * 10_000, None])
        if rng.random() < 0.2:
            body["below_attempt"] = rng.choice([0, 1, 2, 10**9, -1, 2**63 - 1])
        enc = rng.choice(["msgpack", "json"])
        data = _encode_loose(body, enc)
        roll = rng.random()
        if roll < 0.4:
            data = rng.choice(BYTE_MUTATIONS + [lambda r, d: bad_utf8_in_string(r, d, enc)])(rng, data)
        elif roll < 0.5:
            data = rng.choice([b"", rng.randbytes(50), deep_bytes(100_000, enc), b"\xff" * 10])
        subject = (
            self.t.names.cancel(rid)
            if rng.random() < 0.9
            else self.t.names.cancel(rng.choice(["other", "x" * 500]))
        )
        headers = (
            dict(JSON_CT if enc == "json" else MP_CT)
            if rng.random() < 0.8
            else rng.choice([None, {"Content-Type": "text/html"}, dict(MP_CT if enc == "json" else JSON_CT)])
        )
        self.count("cancel")
        self.touched.setdefault(rid, []).append(f"cancel {body.get('below_attempt')}")
        return Shot("pub", subject, data, headers, what=f"cancel {rid!r}")

    # control verbs

    def control(self) -> Shot:
        rng = self.rng
        names, t = self.t.names, self.t
        verb = rng.choice(VERBS_INSTANCE_ONLY + VERBS + ("status-all",))
        if verb == "status-all":
            subject = names.control("status")
        elif verb in VERBS_INSTANCE_ONLY or rng.random() < 0.5:
            subject = names.instance_control(t.instance, verb)
        else:
            subject = names.model_control(t.model, verb)
        enc = rng.choice(["msgpack", "json"])
        body: Any = {
            "lora-load": {
                "v": 1,
                "name": rng.choice(self.adapter_names + ["..", "a" * 200, "-x"]),
                "version": rng.choice([0, 1, 2**62]),
            },
            "lora-unload": {"v": 1, "name": rng.choice(self.adapter_names)},
            "health": {
                "v": 1,
                "canary": rng.random() < 0.3,
                "max_tokens": rng.choice([1, 4, 10**9, -5]),
                "stall_timeout": rng.choice([5.0, 0.0, -1.0, 1e308, 30.0]),
            },
            "sleep": {"v": 1, "level": rng.choice([0, 3, -1, "1", None, 2**63 - 1])},
        }.get(verb.removesuffix("-all"), {"v": 1})
        data = _encode_loose(body, enc)
        roll = rng.random()
        if roll < 0.35:
            data = rng.choice(BYTE_MUTATIONS + [lambda r, d: bad_utf8_in_string(r, d, enc)])(rng, data)
        elif roll < 0.5:
            data = rng.choice(
                [
                    rng.randbytes(rng.randint(1, 500)),
                    deep_bytes(rng.choice([100, 100_000]), enc),
                    b"\xff\xfe",
                    b"x" * 300_000,
                ]
            )
        elif roll < 0.55 and verb != "sleep":
            data = b""
        headers = (
            dict(JSON_CT if enc == "json" else MP_CT)
            if rng.random() < 0.7
            else rng.choice(
                [None, {"Content-Type": "application/xml"}, dict(MP_CT if enc == "json" else JSON_CT)]
            )
        )
        if verb == "sleep" and _valid_sleep(data, headers):
            data = b"\xc1"  # a valid sleep would pause the worker: not what is fuzzed here
        self.count(f"control {verb}")
        roll = rng.random()
        if roll < 0.85:
            reply = f"{t.control_prefix}.{self.n_controls}"
            self.n_controls += 1
            return Shot("pub", subject, data, headers, reply=reply, control=True, what=f"control {verb}")
        reply = None if roll < 0.92 else rng.choice(["$JS.API.INFO", "_INBOX.fz.nobody", "x" * 200])
        return Shot("pub", subject, data, headers, reply=reply, what=f"control {verb} (reply elsewhere)")

    # KV buckets

    def lora_write(self) -> Shot:
        """A write to the LoRA desired-state bucket: garbage keys and values, and specs that cannot load."""
        rng = self.rng
        names, t = self.t.names, self.t
        token = rng.choice(
            [
                encode_token(rng.choice(self.adapter_names)),
                "_FF",
                "_C3_28",
                "_",
                "a_",
                "a_Z",
                "-",
                "__",
                "_ED_A0_80",
                encode_token("x/y"),
                encode_token("a" * 129),
                encode_token("é"),
            ]
        )
        model_tok = encode_token(t.model) if rng.random() < 0.9 else rng.choice(["other", "_FF"])
        key = f"{model_tok}.{token}"
        spec: dict = {
            "v": 1,
            "name": rng.choice(self.adapter_names),
            "source": "path",
            "ref": rng.choice(t.lora_dirs + ["/etc", "relative/x", "/nonexistent", "/"])
            if t.lora_dirs
            else "/nonexistent",
            "version": rng.randint(1, 5),
        }
        roll = rng.random()
        headers: dict[str, str] | None = None
        if roll < 0.25:
            data = _encode_loose(spec, "msgpack")
        elif roll < 0.35:
            spec["source"] = rng.choice(["hub", "object", "s3", None])
            spec["ref"] = rng.choice(["org/repo", "missing", "", "x" * 2000])
            if rng.random() < 0.5:
                spec["sha256"] = rng.choice([hashlib.sha256(b"x").hexdigest(), "zz", None])
            data = _encode_loose(spec, "msgpack")
        elif roll < 0.45:
            data = _encode_loose(spec, "json")  # the bucket holds msgpack
        elif roll < 0.6:
            data = bad_utf8_in_string(rng, _encode_loose(spec, "msgpack"), "msgpack")
        elif roll < 0.75:
            data = rng.choice(BYTE_MUTATIONS)(rng, _encode_loose(spec, "msgpack"))
        elif roll < 0.85:
            data = rng.choice([b"", rng.randbytes(rng.randint(1, 300)), deep_bytes(100_000, "msgpack")])
        else:
            data = b""
            headers = {"KV-Operation": rng.choice(["DEL", "PURGE"])}
            if headers["KV-Operation"] == "PURGE":
                headers["Nats-Rollup"] = "sub"
        self.count("lora bucket write")
        return Shot("pub", f"$KV.{names.lora_bucket}.{key}", data, headers, what=f"lora key {key}")

    def registry_write(self) -> Shot:
        rng = self.rng
        names, t = self.t.names, self.t
        key = rng.choice(
            [
                names.instance_key(t.instance),
                "i._FF",
                "i.x",
                "m._FF",
                names.model_card_key(t.model),
                "m.x",
                "i." + "a" * 200,
            ]
        )
        roll = rng.random()
        headers = None
        if roll < 0.6:
            data = rng.choice(
                [
                    b"",
                    rng.randbytes(rng.randint(1, 300)),
                    b"\xa1\xff",
                    deep_bytes(100_000, "msgpack"),
                    _encode_loose({"v": 1, "instance": "x"}, "msgpack"),
                    _encode_loose(
                        {"v": 1, "instance": "x", "role": "generate", "model": t.model, "state": "serving"},
                        "json",
                    ),
                ]
            )
        elif roll < 0.9:
            data = rng.choice(BYTE_MUTATIONS)(
                rng,
                _encode_loose(
                    {
                        "v": 1,
                        "instance": "fz",
                        "role": "generate",
                        "model": t.model,
                        "state": "serving",
                        "heartbeat_at": 1e18,
                        "expires_after": 0.0,
                    },
                    "msgpack",
                ),
            )
        else:
            data, headers = b"", {"KV-Operation": "DEL"}
        self.count("registry bucket write")
        return Shot("pub", f"$KV.{names.registry_bucket}.{key}", data, headers, what=f"registry key {key}")

    # the request log and JetStream's advisories

    def log_record(self) -> Shot:
        """A forged record in a request's log (workers write it; without auth, anyone can) or where
        durable cancels go (producers may write that)."""
        rng = self.rng
        upcoming = f"fz{self.seed}-{self.n_jobs + rng.randint(0, 40)}"
        rid = rng.choice(self.rids) if self.rids and rng.random() < 0.3 else upcoming
        frame = {
            "kind": "tokens",
            "seq": rng.choice([1, 5, 10**9]),
            "attempt": 1,
            "index": rng.choice([0, 3]),
            "token_ids": rng.choice([[5], [self.t.vocab + 5], []]),
        }
        record = rng.choice(
            [
                {
                    "kind": "claim",
                    "attempt": rng.choice([1, 10**6]),
                    "worker": rng.choice(["ghost", t_inst(self), ""]),
                    "at": 0.0,
                },
                {"kind": "step", "attempt": 1, "frame": frame},
                {"kind": "handoff", "attempt": 1, "reason": "fz"},
                {"kind": "cancelled", "attempt": 0, "reason": "forged"},
                {"kind": "result", "attempt": 1},
                {
                    "kind": "result",
                    "attempt": 1,
                    "error": {
                        "kind": "error",
                        "seq": 3,
                        "attempt": 1,
                        "request_id": rid,
                        "code": "internal",
                        "message": "forged",
                    },
                },
                {
                    "kind": "result",
                    "attempt": 1,
                    "token_ids": [[1, 2]],
                    "text": [],
                    "final": {
                        "kind": "final",
                        "seq": 2,
                        "attempt": 1,
                        "request_id": rid,
                        "choices": [],
                        "usage": {},
                    },
                },
            ]
        )
        data = _encode_loose(record, "msgpack")
        if rng.random() < 0.3:
            data = rng.choice(BYTE_MUTATIONS + [lambda r, d: bad_utf8_in_string(r, d, "msgpack")])(rng, data)
        # producers may write only the durable cancel's subject: whatever is stored there must only cancel
        as_cancel = rng.random() < 0.3
        where = "durable cancel" if as_cancel else "log"
        subject = self.t.names.cancelled(rid) if as_cancel else self.t.names.request_log(rid)
        self.count(f"{where} record")
        self.touched.setdefault(rid, []).append(
            f"{where} {record['kind']}{'' if 'final' in record or 'error' in record else '-'}"
        )
        return Shot("pub", subject, data, what=f"{where} record for {rid}: {record['kind']}")

    def advisory(self) -> Shot:
        rng = self.rng
        data = rng.choice(
            [
                b"",
                b"{}",
                b"null",
                b"[]",
                b'{"stream_seq": "x"}',
                b'{"stream_seq": -1}',
                b'{"stream_seq": 0}',
                b'{"stream_seq": 1e400}',
                b'{"stream_seq": 99999999999999999999999}',
                b'{"stream_seq": 4000000000000}',
                rng.randbytes(100),
                b"\xff" * 5,
                b'{"stream_seq": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            ]
        )
        self.count("max-deliveries advisory")
        return Shot(
            "pub", self.t.names.max_deliveries_advisory("generate", self.t.model), data, what="advisory"
        )

    # the mix

    def plan(self, n: int) -> list[Shot]:
        kinds = [
            (self.job, 0.57),
            (self.shard, 0.03),
            (self.job_elsewhere, 0.03),
            (self.raw_job, 0.02),
            (self.cancel, 0.12),
            (self.control, 0.13),
            (self.lora_write, 0.03),
            (self.registry_write, 0.02),
            (self.log_record, 0.04),
            (self.advisory, 0.01),
        ]
        makers = [k for k, _ in kinds]
        weights = [w for _, w in kinds]
        return [self.rng.choices(makers, weights)[0]() for _ in range(n)]


def t_inst(g: Generator) -> str:
    return g.t.instance


def _set(d: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        nxt = d.get(key)
        if not isinstance(nxt, dict):
            nxt = {}
            d[key] = nxt
        d = nxt
    d[path[-1]] = value


_mp = msgspec.msgpack.Encoder()
_js = msgspec.json.Encoder()


def _encode_loose(obj: Any, enc: str) -> bytes:
    """Encode anything the test built (bytes become base64 in JSON, as the codec does)."""
    try:
        return _js.encode(obj) if enc == "json" else _mp.encode(obj)
    except (OverflowError, TypeError, ValueError):
        return _mp.encode(repr(obj)) if enc == "msgpack" else json.dumps(repr(obj)).encode()


def _valid_sleep(data: bytes, headers: dict[str, str] | None) -> bool:
    if not data:
        return True
    try:
        level = codec.Decoder(SleepRequest).decode(data, codec.encoding_of(headers)).level
    except Exception:
        return False
    return level in (1, 2)


def _parse_headers(block: bytes) -> dict[str, str] | None:
    """The headers as nats-py hands them to the worker (its own parser, run without a connection)."""
    from nats.aio.client import Client as NATS

    nc = NATS()

    async def quiet(e: Exception) -> None:
        pass

    nc._error_cb = quiet
    run = nc._process_headers(block)  # never suspends: drive it by hand
    try:
        run.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("nats-py's header parser suspended")


_PREFIX_REF = re.compile(rb"[A-Za-z0-9_.]+\.\d+")


def expectation(data: bytes, headers: dict[str, str] | None, frames_prefix: str) -> JobExpect:
    """The reply subject the worker's own decoder finds for these bytes, if any."""
    try:
        req, _ = decode_request(data, headers)
        reply = req.reply_to
        return JobExpect(reply if reply and is_safe_reply_subject(reply) else None, True, [], "")
    except RejectedJob as exc:
        return JobExpect(exc.reply_to, True, [], "")
    except Exception:  # undecodable beyond salvage (today: UnicodeDecodeError, RecursionError)
        prefix = frames_prefix.encode()
        found = {m.decode("ascii", "replace") for m in _PREFIX_REF.findall(data) if m.startswith(prefix)}
        return JobExpect(None, False, sorted(found), "")


_shard_decoder = codec.Decoder(ShardJob)


def _shard_runs_long(data: bytes, enc: str) -> bool:
    """Whether a shard decodes with a request that would run longer than the barrage allows."""
    try:
        shard = _shard_decoder.decode(data, enc)  # type: ignore[arg-type]
    except Exception:
        return False
    return (
        any(
            r.stop.max_tokens is None
            or r.stop.max_tokens > MAX_TOKENS_RUN
            or r.sampling.n > 4
            or r.stop.min_tokens > MAX_TOKENS_RUN
            for r in shard.requests
        )
        or len(shard.requests) > 64
    )


def decodes_to_long_job(data: bytes, headers: dict[str, str] | None) -> bool:
    """Whether a mutated job would run longer than the barrage allows (no max_tokens, many choices)."""
    try:
        req, _ = decode_request(data, headers)
    except Exception:
        return False
    return (
        req.stop.max_tokens is None
        or req.stop.max_tokens > MAX_TOKENS_RUN
        or req.sampling.n > 4
        or req.stop.min_tokens > MAX_TOKENS_RUN
    )
