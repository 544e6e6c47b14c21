"""`jetllm schema` and `jetllm flags`: the wire contract and the command reference, for other
languages and for the generated parts of docs/messages.md and docs/operations.md."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def wire_types() -> dict[str, object]:
    """Every message that crosses NATS (or a batch file) as a whole, by the name its schema file
    gets; the structs inside them (prompts, options, choices, events, ...) come along as `$defs`.
    A test fails when a struct in jetllm.schemas is not reachable from here."""
    from .. import schemas as s

    return {
        # jobs and what a producer sends about them
        "GenerateRequest": s.GenerateRequest,
        "ShardJob": s.ShardJob,
        "CancelRequest": s.CancelRequest,
        # what comes back: frames on the reply subject, the request log, dead letters, traces
        "Frame": s.Frame,
        "FrameBatch": s.FrameBatch,
        "ResumeQuery": s.ResumeQuery,
        "Delivered": s.Delivered,
        "Record": s.Record,
        "DeadLetter": s.DeadLetter,
        "TraceRecord": s.TraceRecord,
        # control verbs and their replies
        "StatusRequest": s.StatusRequest,
        "WorkerStatus": s.WorkerStatus,
        "HealthCheck": s.HealthCheck,
        "HealthReport": s.HealthReport,
        "SleepRequest": s.SleepRequest,
        "ControlDone": s.ControlDone,
        "ControlFailed": s.ControlFailed,
        "TasksReport": s.TasksReport,
        "TaskWait": s.TaskWait,
        # the fleet's shared view
        "InstanceRecord": s.InstanceRecord,
        "ModelCard": s.ModelCard,
        "LoadReport": s.LoadReport,
        "Routed": s.Routed,
        "KvEventBatch": s.KvEventBatch,
        # LoRA adapters: the desired set, its verbs and replies
        "AdapterSpec": s.AdapterSpec,
        "AdapterManifest": s.AdapterManifest,
        "LoraLoad": s.LoraLoad,
        "LoraUnload": s.LoraUnload,
        "AdapterReply": s.AdapterReply,
        "AdapterList": s.AdapterList,
        # prefill/decode handoff: the prefill job, its answer, the blocks' header on their subject
        "PrefillRequest": s.PrefillRequest,
        "Prefilled": s.Prefilled,
        "KvBlocksHeader": s.KvBlocksHeader,
        "KvReceived": s.KvReceived,
        # batch files
        "BatchLine": s.BatchLine,
        "BatchResult": s.BatchResult,
        # the batch API: a batch to run, its state, a file's metadata
        "BatchRun": s.BatchRun,
        "BatchState": s.BatchState,
        "FileMeta": s.FileMeta,
    }


def json_schemas() -> dict[str, dict]:
    import msgspec

    return {name: _open_error_codes(msgspec.json.schema(t)) for name, t in wire_types().items()}


def _open_error_codes(schema: dict) -> dict:
    """Error codes are an open set on the wire (newer workers add codes, older readers keep the
    string): the schema lists the known ones but accepts any string, so generated readers do too."""
    codes = schema.get("$defs", {}).get("ErrorCode")
    if codes is not None and "enum" in codes:
        known = codes.pop("enum")
        codes["anyOf"] = [{"enum": known}, {"type": "string"}]
        codes["description"] = (
            "Machine-readable error code. Codes not listed come from newer writers: "
            "read them as a failure, keeping the code as sent."
        )
    return schema


def cmd_schema(args: argparse.Namespace) -> int:
    if args.markdown:
        from .reference import messages_reference, splice

        text = messages_reference()
        if args.write:
            Path(args.write).write_text(splice(Path(args.write), text))
        else:
            sys.stdout.write(text)
        return 0
    schemas = json_schemas()
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        for name, schema in schemas.items():
            (out / f"{name}.schema.json").write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        print(f"wrote {len(schemas)} schemas to {out}", file=sys.stderr)
    else:
        json.dump(schemas, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    return 0


def cmd_flags(args: argparse.Namespace) -> int:
    from . import parser
    from .reference import flags_reference, splice

    text = flags_reference(parser())
    if args.write:
        Path(args.write).write_text(splice(Path(args.write), text))
    else:
        sys.stdout.write(text)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "schema",
        help="write the JSON Schema of every message",
        description="Write the JSON Schema of every wire message (one file each with -o).",
    )
    p.add_argument(
        "-o", "--output", default=None, help="directory for NAME.schema.json files (default: stdout)"
    )
    p.add_argument("--markdown", action="store_true", help="the message reference as markdown tables instead")
    p.add_argument(
        "--write",
        default=None,
        metavar="FILE",
        help="with --markdown: replace the generated section of FILE (docs/messages.md)",
    )
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser(
        "flags",
        help="print the reference of every command and flag (markdown)",
        description="Print every command and flag as markdown, as in docs/operations.md.",
    )
    p.add_argument(
        "--write",
        default=None,
        metavar="FILE",
        help="replace the generated section of FILE (docs/operations.md)",
    )
    p.set_defaults(func=cmd_flags)
