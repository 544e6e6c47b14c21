"""The files of a LoRA adapter as jetllm handles them: which files, their content hash, and
bounded reads of their headers. Shared by `jetllm lora push` and the workers.

Only `adapter_config.json` and `adapter_model.safetensors` make an adapter here: pickle formats
(`.bin`, `.pt`) run code when loaded and are never read. The adapter's content hash is the sha256
of the lines `<file> <sha256 of its bytes>` in file-name order, so the same files give the same
hash wherever they are.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

from .errors import JetllmError
from .schemas import ErrorCode

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG, WEIGHTS)
MAX_CONFIG_BYTES = 1 << 20
MAX_WEIGHTS_BYTES = 2 << 30
MAX_HEADER_BYTES = 16 << 20
_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}


class AdapterFileError(JetllmError):
    """The adapter cannot be used; `code` says why in the wire's terms."""


def short(name: str) -> str:
    """A name from an adapter's files, quoted and cut to fit in an error reply."""
    return repr(name) if len(name) <= 120 else f"{name[:60]!r}... ({len(name)} characters)"


def max_bytes(file: str) -> int:
    return MAX_CONFIG_BYTES if file == CONFIG else MAX_WEIGHTS_BYTES


def file_sha256(path: Path, limit: int) -> str:
    h = hashlib.sha256()
    seen = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            seen += len(chunk)
            if seen > limit:
                raise AdapterFileError(
                    f"{path.name} is larger than {limit} bytes", code=ErrorCode.ADAPTER_INVALID
                )
            h.update(chunk)
    return h.hexdigest()


def combined_sha256(files: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{name} {files[name]}\n" for name in sorted(files)).encode()).hexdigest()


def check_present(directory: Path) -> None:
    missing = [f for f in ADAPTER_FILES if not (directory / f).is_file()]
    if missing:
        pickles = sorted(p.name for p in directory.glob("adapter_model.*") if p.suffix in (".bin", ".pt"))
        hint = (
            f" (found {', '.join(pickles)}: pickle formats are refused, convert to safetensors)"
            if pickles
            else ""
        )
        raise AdapterFileError(
            f"the adapter lacks {', '.join(missing)}{hint}", code=ErrorCode.ADAPTER_INVALID
        )


def digests(directory: Path) -> dict[str, str]:
    """sha256 of each adapter file (sizes bounded)."""
    check_present(directory)
    return {f: file_sha256(directory / f, max_bytes(f)) for f in ADAPTER_FILES}


def _json(data: bytes, what: str) -> Any:
    """Parsed JSON, or ADAPTER_INVALID naming `what`: anyone can write an adapter's files, and
    json's own limits (integers over 4300 digits, nesting past the recursion limit) are failures
    of the file, not of jetllm."""
    try:
        return json.loads(data)
    except RecursionError:
        raise AdapterFileError(f"{what} is nested too deeply", code=ErrorCode.ADAPTER_INVALID) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an over-long integer
        raise AdapterFileError(f"{what} is not usable JSON: {exc}", code=ErrorCode.ADAPTER_INVALID) from None


def read_config(path: Path) -> dict[str, Any]:
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterFileError(
            f"{CONFIG} is larger than {MAX_CONFIG_BYTES} bytes", code=ErrorCode.ADAPTER_INVALID
        )
    config = _json(path.read_bytes(), CONFIG)
    if not isinstance(config, dict):
        raise AdapterFileError(f"{CONFIG} must hold a JSON object", code=ErrorCode.ADAPTER_INVALID)
    return config


def read_safetensors_header(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Tensor name -> (dtype, shape), after checking that the header is sound and that every
    tensor lies inside the file where its dtype and shape say."""
    size = os.path.getsize(path)
    bad = ErrorCode.ADAPTER_INVALID
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise AdapterFileError(f"{WEIGHTS} is too short to be safetensors", code=bad)
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise AdapterFileError(
                f"{WEIGHTS} has a corrupt header (length {n}, file {size} bytes)", code=bad
            )
        header = _json(f.read(n), f"the header of {WEIGHTS}")
    if not isinstance(header, dict):
        raise AdapterFileError(f"{WEIGHTS} has a corrupt header (not an object)", code=bad)
    header.pop("__metadata__", None)
    data = size - 8 - n
    tensors: dict[str, tuple[str, list[int]]] = {}
    for name, info in header.items():
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            count = 1
            for d in shape:
                count *= int(d)
            ok = dtype in _DTYPES and 0 <= start <= end <= data and end - start == count * _DTYPES[dtype]
        except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: int(1e400)
            ok = False
        if not ok:
            raise AdapterFileError(
                f"{WEIGHTS}: tensor {short(name)} is corrupt or of an unsupported dtype "
                f"(supported: {', '.join(_DTYPES)})",
                code=bad,
            )
        tensors[name] = (dtype, [int(d) for d in shape])
    if not tensors:
        raise AdapterFileError(f"{WEIGHTS} holds no tensors", code=bad)
    return tensors
