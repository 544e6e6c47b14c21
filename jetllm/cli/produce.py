"""Producer commands: `jetllm generate` streams one request, `jetllm batch` runs a JSONL file."""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
import uuid
from pathlib import Path

import msgspec

from ..aio import run
from ..batch import run_batch
from ..errors import ConnectRefused, InsecureConnection, JetllmError, NatsSettingsError, NotPermitted
from ..schemas import (
    AcceptedFrame,
    ChatMessage,
    ChatPrompt,
    ChoiceOutput,
    ErrorFrame,
    FinalFrame,
    GenerateRequest,
    GrammarOutput,
    JsonObjectOutput,
    JsonSchemaOutput,
    OutputOptions,
    Prompt,
    RegexOutput,
    SamplingOptions,
    StopConditions,
    StructuredOutput,
    TextPrompt,
    TokensFrame,
    TokensPrompt,
)
from .common import TINY_MODEL_NAME, add_nats, nats_url


def add_sampling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling and stopping")
    g.add_argument("--max-tokens", type=int, default=None, help="default: the room left in the context")
    g.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop before this many tokens")
    g.add_argument("--temperature", type=float, default=None, help="default: the model's (0 = greedy)")
    g.add_argument("--top-p", type=float, default=None, help="default: the model's")
    g.add_argument("--top-k", type=int, default=None, help="default: the model's")
    g.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def add_structured(p: argparse.ArgumentParser, scope: str = "") -> None:
    g = p.add_argument_group(
        "structured output", f"constrain the output{scope} to one of these (docs/messages.md)"
    ).add_mutually_exclusive_group()
    g.add_argument(
        "--json-schema", metavar="FILE", default=None, help="one JSON document valid against this schema"
    )
    g.add_argument("--json-object", action="store_true", help="one JSON object, of any shape")
    g.add_argument("--regex", metavar="PATTERN", default=None, help="text matching this regular expression")
    g.add_argument(
        "--choice", metavar="TEXT", action="append", default=None, help="exactly one of these (repeatable)"
    )
    g.add_argument(
        "--grammar", metavar="FILE", default=None, help="a sentence of this grammar (GBNF or Lark)"
    )


def _read_text(flag: str, path: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"{flag}: cannot read {path}: {exc}") from None


def structured_from_args(args: argparse.Namespace) -> StructuredOutput | None:
    """The constraint the flags ask for; files are read here, so a bad one stops the command early."""
    if args.json_schema is not None:
        try:
            schema = msgspec.json.decode(_read_text("--json-schema", args.json_schema))
        except msgspec.DecodeError as exc:
            raise SystemExit(f"--json-schema: {args.json_schema} is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise SystemExit(f"--json-schema: {args.json_schema} must hold a JSON object (a schema)")
        return JsonSchemaOutput(json_schema=schema)
    if args.json_object:
        return JsonObjectOutput()
    if args.regex is not None:
        return RegexOutput(pattern=args.regex)
    if args.choice:
        return ChoiceOutput(choices=list(args.choice))
    if args.grammar is not None:
        return GrammarOutput(grammar=_read_text("--grammar", args.grammar))
    return None


def request_from_args(args: argparse.Namespace) -> GenerateRequest:
    prompt: Prompt
    if args.tokens:
        try:
            prompt = TokensPrompt([int(t) for t in args.tokens.replace(",", " ").split()])
        except ValueError:
            raise SystemExit("--tokens takes integers separated by commas or spaces") from None
    elif args.chat:
        messages = [ChatMessage(role="system", content=args.system)] if args.system else []
        messages.append(ChatMessage(role="user", content=args.text))
        prompt = ChatPrompt(messages)
    else:
        prompt = TextPrompt(args.text)
    return GenerateRequest(
        request_id=args.request_id or f"gen-{uuid.uuid4().hex}",
        model=args.model,
        prompt=prompt,
        sampling=SamplingOptions(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
        ),
        stop=StopConditions(
            max_tokens=args.max_tokens, min_tokens=args.min_tokens, stop=args.stop, ignore_eos=args.ignore_eos
        ),
        output=OutputOptions(text=None if not args.tokens else bool(args.text_out)),
        structured=structured_from_args(args),
    )


async def _generate(args: argparse.Namespace) -> int:
    from ..producer import Client

    try:
        req = msgspec.convert(msgspec.to_builtins(request_from_args(args)), GenerateRequest)
    except msgspec.ValidationError as exc:
        print(f"error: invalid request: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    async with Client(
        nats_url(args), namespace=args.namespace, heartbeat_timeout=args.heartbeat_timeout
    ) as c:
        first = None
        async for frame in c.generate(req, accept_timeout=args.accept_timeout, instance=args.instance):
            if args.json:
                sys.stdout.write(msgspec.json.encode(frame).decode() + "\n")
                sys.stdout.flush()
                if isinstance(frame, ErrorFrame):
                    return 1
                continue
            if isinstance(frame, AcceptedFrame):
                print(f"[accepted by {frame.worker}]", file=sys.stderr, flush=True)
            elif isinstance(frame, TokensFrame):
                first = first or time.monotonic()
                sys.stdout.write(
                    frame.text if frame.text is not None else " ".join(map(str, frame.token_ids)) + " "
                )
                sys.stdout.flush()
            elif isinstance(frame, FinalFrame):
                ch = frame.choices[0]
                u = frame.usage
                ttft = f"{(first - started) * 1000:.0f} ms" if first else "-"
                print(
                    f"\n[{ch.finish_reason}; prompt {u.prompt_tokens} tokens ({u.cached_tokens} cached), "
                    f"completion {u.completion_tokens}; first token {ttft}, "
                    f"total {(time.monotonic() - started) * 1000:.0f} ms]",
                    file=sys.stderr,
                )
            elif isinstance(frame, ErrorFrame):
                where = f" at {frame.field}" if frame.field else ""
                print(f"\nerror: {frame.code.value}{where}: {frame.message}", file=sys.stderr)
                return 1
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    if not args.text and not args.tokens:
        raise SystemExit("give a prompt text, or --tokens")
    try:
        return run(_generate, args)
    except (ConnectionError, ConnectRefused, InsecureConnection, NatsSettingsError, NotPermitted) as exc:
        print(f"error: {exc}", file=sys.stderr)  # about the connection, not the request: no code
        return 1
    except JetllmError as exc:
        print(f"error: {exc.code.value}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def batch_id(path: Path, model: str, extra: str = "") -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    h.update(f"\0{model}\0{extra}".encode())
    return h.hexdigest()[:16]


def _durable(args: argparse.Namespace) -> int | None:
    """`--detach`, `--follow`, `--download`: batches kept in NATS and run by batch runners."""
    from . import batches_cmd

    if args.follow:
        return run(batches_cmd.follow, args, args.follow)
    if args.download:
        return run(batches_cmd.download, args, args.download[0], Path(args.download[1]))
    if args.detach:
        path = Path(args.input or "")
        if not path.is_file():
            raise SystemExit(f"--detach needs an input file; no such file: {path}")
        return run(batches_cmd.detach, args, path)
    return None


def cmd_batch(args: argparse.Namespace) -> int:
    durable = _durable(args)
    if durable is not None:
        return durable
    if not args.input:
        raise SystemExit("give an input file (or --follow ID, --download ID OUT)")
    path = Path(args.input)
    if not path.is_file():
        raise SystemExit(f"no such input file: {path}")
    out = Path(args.output) if args.output else path.with_suffix(".results.jsonl")
    structured = structured_from_args(args)
    constraint = msgspec.json.encode(structured).decode() if structured is not None else ""
    bid = args.batch_id or batch_id(path, args.model, constraint)
    try:
        summary = run(
            lambda: run_batch(
                nats_url(args),
                args.namespace,
                path,
                out,
                model=args.model,
                batch_id=bid,
                concurrency=args.concurrency,
                max_tokens=args.max_tokens,
                structured=structured,
                progress=not args.quiet and sys.stderr.isatty() or args.progress,
                heartbeat_timeout=args.heartbeat_timeout,
            )
        )
    except (JetllmError, ConnectionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(summary.describe(out), file=sys.stderr)
    if args.print:
        sys.stdout.write(out.read_text())
    return 0 if summary.errors == 0 else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="stream one request to stdout",
        description="Submit one generate job and stream its text (or tokens) to stdout.",
    )
    add_nats(p)
    p.add_argument("text", nargs="?", default="", help="the prompt")
    p.add_argument("--model", default=TINY_MODEL_NAME, help=f"model name (default: {TINY_MODEL_NAME})")
    p.add_argument(
        "--chat", action="store_true", help="send the text as a user chat message (chat template applied)"
    )
    p.add_argument("--system", default=None, help="system message, with --chat")
    p.add_argument("--tokens", default=None, help="send token ids instead of text, e.g. '1,5,7'")
    p.add_argument("--text-out", action="store_true", help="with --tokens: also stream text")
    p.add_argument("--request-id", default=None, help="default: a random one (a request id runs once)")
    p.add_argument("--json", action="store_true", help="print every frame as a JSON line")
    p.add_argument(
        "--instance",
        default=None,
        help="address the job to this worker instance (see `jetllm status`); it goes to the shared "
        "queue instead when that instance is not serving the model",
    )
    p.add_argument(
        "--accept-timeout",
        type=float,
        default=None,
        help="give up if no worker accepts the job within this many seconds (default: wait)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        help="after this many seconds without a frame, read the request log for an end a lost frame "
        "carried (a dead worker is found sooner, from the server, and its request moves on)",
    )
    add_sampling(p)
    add_structured(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "batch",
        help="run a JSONL file of prompts, one result per line",
        description="Submit every line of INPUT as a job; write one result per input line, in input order.",
    )
    add_nats(p)
    p.add_argument(
        "input",
        nargs="?",
        help="JSONL: one object per line with prompt | messages | token_ids (see docs/messages.md); "
        "with --detach, OpenAI's batch input format (custom_id, method, url, body)",
    )
    p.add_argument("-o", "--output", default=None, help="results file (default: INPUT with .results.jsonl)")
    p.add_argument("--model", default=TINY_MODEL_NAME, help="model for lines that name none")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    p.add_argument("--max-tokens", type=int, default=None, help="default max_tokens for lines that set none")
    p.add_argument("--batch-id", default=None, help="default: a hash of the input file, model and constraint")
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=30.0,
        help="after this many seconds without a frame, read the request's log for an end a lost frame "
        "carried (a dead worker is found sooner, from the server, and its request moves on)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--progress", action="store_true", help="progress bar even when stderr is not a terminal")
    p.add_argument("--print", action="store_true", help="print the results file when done")
    add_structured(p, " of lines that set no `structured`")
    g = p.add_argument_group("durable batches (kept in NATS, run by batch runners on the fleet)")
    g.add_argument(
        "--detach",
        action="store_true",
        help="upload INPUT (OpenAI batch format), create a batch and print its id; `jetllm batch-runner` "
        "or a gateway runs it, whatever happens to this command",
    )
    g.add_argument("--completion-window", default="24h", help="with --detach: when unfinished lines expire")
    g.add_argument("--follow", metavar="ID", default=None, help="show a batch's progress until it ends")
    g.add_argument(
        "--download",
        nargs=2,
        metavar=("ID", "OUT"),
        default=None,
        help="write a finished batch's output file to OUT (its error file to OUT.errors.jsonl)",
    )
    p.set_defaults(func=cmd_batch)
