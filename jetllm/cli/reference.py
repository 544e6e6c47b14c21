"""Generated reference sections of docs/messages.md and docs/operations.md.

The docs hold the rendered text between markers; a test fails when it drifts from the code, and
`jetllm schema --markdown --write docs/messages.md` (or `jetllm help-flags --write ...`) renews it.
"""

from __future__ import annotations

import argparse
import ast
import inspect
from pathlib import Path

import msgspec
from msgspec import inspect as mi

from .. import schemas as s

BEGIN = "<!-- generated:begin -->"
END = "<!-- generated:end -->"

SECTIONS: list[tuple[str, list[type]]] = [
    (
        "Generate job",
        [
            s.GenerateRequest,
            s.TokensPrompt,
            s.ChatPrompt,
            s.ChatMessage,
            s.ToolCall,
            s.ToolCallFunction,
            s.ToolSpec,
            s.ToolFunction,
            s.TextPrompt,
            s.EmbedsPrompt,
            s.SamplingOptions,
            s.StopConditions,
            s.OutputOptions,
            s.JsonSchemaOutput,
            s.JsonObjectOutput,
            s.RegexOutput,
            s.ChoiceOutput,
            s.GrammarOutput,
        ],
    ),
    (
        "Reply frames",
        [
            s.PulledFrame,
            s.AcceptedFrame,
            s.TokensFrame,
            s.HeartbeatFrame,
            s.FinalFrame,
            s.Choice,
            s.Usage,
            s.ErrorFrame,
        ],
    ),
    ("Shard job: many batch lines as one job", [s.ShardJob]),
    ("Frame batches", [s.FrameBatch, s.BatchedFrame]),
    ("Taking a request over", [s.ResumeQuery, s.Delivered]),
    ("Request log", [s.Claim, s.Steps, s.Step, s.Handoff, s.Cancelled, s.Result, s.ChoiceLogprobs]),
    ("Control", [s.CancelRequest, s.StatusRequest, s.WorkerStatus]),
    (
        "Fleet: registry, load, control replies",
        [
            s.InstanceRecord,
            s.EngineInfo,
            s.ModelCard,
            s.LoadReport,
            s.Routed,
            s.HealthCheck,
            s.HealthReport,
            s.SleepRequest,
            s.ControlDone,
            s.ControlFailed,
            s.TasksReport,
            s.TaskWait,
        ],
    ),
    ("Tracing", [s.TraceRecord, s.RouteDecision, s.RouteCandidate]),
    ("Prefill/decode handoff", [s.PrefillRequest, s.Prefilled, s.KvBlocksHeader, s.KvLayer, s.KvReceived]),
    (
        "LoRA adapters",
        [
            s.AdapterSpec,
            s.AdapterManifest,
            s.LoraLoad,
            s.LoraUnload,
            s.AdapterReply,
            s.AdapterList,
            s.LoadedAdapter,
        ],
    ),
    ("KV-cache events", [s.KvEventBatch, s.KvStored, s.KvRemoved, s.KvCleared, s.KvResync]),
    ("Dead letters", [s.DeadLetter]),
    ("Batch files", [s.BatchLine, s.BatchResult, s.BatchError]),
    ("Batch API state", [s.BatchRun, s.BatchState, s.RequestCounts, s.BatchIssue, s.FileMeta]),
]


def _attribute_docs(cls: type) -> dict[str, str]:
    """Docstrings written under fields (`x: int = 0` followed by a string), by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__ == "builtins" or not klass.__module__.startswith("jetllm"):
            continue
        tree = ast.parse(inspect.getsource(klass))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for stmt, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type(t: mi.Type) -> str:
    if isinstance(t, mi.Metadata):
        return _type(t.type)
    if isinstance(t, mi.UnionType):
        return " \\| ".join(_type(x) for x in t.types)
    if isinstance(t, mi.NoneType):
        return "null"
    if isinstance(t, mi.ListType):
        return f"list[{_type(t.item_type)}]"
    if isinstance(t, mi.DictType):
        return f"map[{_type(t.key_type)}, {_type(t.value_type)}]"
    if isinstance(t, mi.StructType):
        return f"[{t.cls.__name__}](#{t.cls.__name__.lower()})"
    if isinstance(t, mi.EnumType):
        return f"[{t.cls.__name__}](#{t.cls.__name__.lower()})"
    if isinstance(t, mi.LiteralType):
        return " \\| ".join(f"`{v!r}`".replace("'", '"') for v in t.values)
    names = {
        mi.IntType: "int",
        mi.FloatType: "float",
        mi.StrType: "str",
        mi.BoolType: "bool",
        mi.BytesType: "bytes",
        mi.AnyType: "any",
    }
    base = names.get(type(t), type(t).__name__.removesuffix("Type").lower())
    limits = []
    for attr, sym in (
        ("ge", ">="),
        ("gt", ">"),
        ("le", "<="),
        ("lt", "<"),
        ("min_length", "len >="),
        ("max_length", "len <="),
        ("pattern", "matches"),
    ):
        value = getattr(t, attr, None)
        if value is not None:
            limits.append(f"{sym} `{value}`" if attr == "pattern" else f"{sym} {value}")
    return f"{base} ({', '.join(limits)})" if limits else base


def _description(t: mi.Type) -> str:
    if isinstance(t, mi.Metadata):
        return (t.extra_json_schema or {}).get("description", "") or _description(t.type)
    if isinstance(t, mi.UnionType):
        return next((d for d in map(_description, t.types) if d), "")
    return ""


def _default(f: mi.Field) -> str:
    if f.required:
        return "required"
    if f.default is not msgspec.NODEFAULT:
        value = f.default
        if isinstance(value, msgspec.Struct):
            return f"{type(value).__name__}()"
        return f"`{msgspec.json.encode(value).decode()}`"
    if f.default_factory is not msgspec.NODEFAULT:
        made = f.default_factory()
        return (
            f"{type(made).__name__}()"
            if isinstance(made, msgspec.Struct)
            else f"`{msgspec.json.encode(made).decode()}`"
        )
    return ""


def struct_table(cls: type) -> str:
    info = mi.type_info(cls)
    if not isinstance(info, mi.StructType):
        raise TypeError(f"{cls.__name__} is not a msgspec Struct")
    docs = _attribute_docs(cls)
    tag = f' — `{info.tag_field}: "{info.tag}"`' if getattr(info, "tag", None) else ""
    lines = [f"### {cls.__name__}{tag}", ""]
    if cls.__doc__:
        lines += [" ".join(cls.__doc__.split()), ""]
    lines += [_RULE[issubclass(cls, s.Strict)], ""]
    lines += ["| field | type | default | meaning |", "|---|---|---|---|"]
    for f in info.fields:
        meaning = docs.get(f.name) or _description(f.type)
        lines.append(f"| `{f.encode_name}` | {_type(f.type)} | {_default(f)} | {meaning} |")
    return "\n".join(lines) + "\n"


_RULE = {
    True: "Strict: a field the reader does not know is refused, naming it.",
    False: "Tolerant: a reader skips fields it does not know.",
}


def messages_reference() -> str:
    parts = []
    for title, types in SECTIONS:
        parts.append(f"## {title}\n")
        parts.extend(struct_table(t) for t in types)
    parts.append("## ErrorCode\n")
    docs = _enum_docs(s.ErrorCode)
    parts.append(
        "| code | meaning |\n|---|---|\n"
        + "".join(f"| `{c.value}` | {docs.get(c.name, '')} |\n" for c in s.ErrorCode)
    )
    return "\n".join(parts)


def _enum_docs(enum_cls: type) -> dict[str, str]:
    tree = ast.parse(inspect.getsource(enum_cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    out = {}
    for stmt, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(stmt, ast.Assign)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            out[stmt.targets[0].id] = " ".join(nxt.value.value.split())  # type: ignore[attr-defined]
    return out


def flags_reference(parser: argparse.ArgumentParser) -> str:
    """Every command and flag of the CLI, with its help text."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands: list[tuple[str, argparse.ArgumentParser]] = []
    for name, p in sub.choices.items():
        nested = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if nested:
            commands.extend((f"{name} {verb}", vp) for verb, vp in nested[0].choices.items())
        else:
            commands.append((name, p))
    parts = []
    for name, p in commands:
        parts.append(f"### `jetllm {name}`\n\n{p.description or ''}\n")
        parts.append("| flag | default | meaning |\n|---|---|---|")
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            flag = ", ".join(f"`{o}`" for o in a.option_strings) or f"`{a.dest.upper()}` (positional)"
            default = "" if a.default in (None, argparse.SUPPRESS, False, []) else f"`{a.default}`"
            help_text = (a.help or "").replace("|", "\\|").replace("%%", "%")
            parts.append(f"| {flag} | {default} | {help_text} |")
        parts.append("")
    return "\n".join(parts)


def splice(path: Path, generated: str) -> str:
    """The file's text with its generated section replaced."""
    text = path.read_text()
    head, sep, rest = text.partition(BEGIN)
    if not sep:
        raise ValueError(f"{path} has no {BEGIN} marker")
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{generated}{END}{tail}"


def generated_section(path: Path) -> str:
    text = path.read_text()
    return text.partition(BEGIN)[2].partition(END)[0].removeprefix("\n")
