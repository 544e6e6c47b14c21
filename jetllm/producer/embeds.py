"""Producer side of embeddings prompts: raw bytes from an array, the object store for big ones.

numpy is imported only when an array is converted; torch never (a torch user passes
`tensor.numpy()`, or for bfloat16 `tensor.view(torch.int16).numpy()` with `dtype="bfloat16"`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import anyio
from nats.js import JetStreamContext
from nats.js.api import ObjectMeta, ObjectMetaOptions, ObjectStoreConfig, StorageType
from nats.js.object_store import ObjectStore

from ..schemas import EmbedsPrompt
from ..subjects.names import Names
from ..subjects.setup import ensure_bucket, namespace_replicas

CHUNK_SIZE = 512 * 1024
"""Object chunk size: well under the smallest usual max_payload (1 MB), few round trips."""


def embeds_prompt(array: Any, *, dtype: str | None = None) -> EmbedsPrompt:
    """An inline EmbedsPrompt from a 2-D array of float32 or float16 (or bfloat16 from
    ml_dtypes; or 16-bit integers holding bfloat16 bits with `dtype="bfloat16"`)."""
    import numpy as np

    arr = np.asarray(array)
    name = dtype or arr.dtype.name
    wire: np.dtype[Any]
    if name == "bfloat16":
        if arr.dtype.itemsize != 2:
            raise ValueError(f"bfloat16 needs 2-byte elements, got {arr.dtype}")
        arr = arr.view(np.uint16)
        wire = np.dtype("<u2")
    elif name in ("float32", "float16"):
        wire = np.dtype("<f4" if name == "float32" else "<f2")
        if dtype is not None and arr.dtype.kind != "f":
            raise ValueError(f"dtype={dtype!r} needs a float array, got {arr.dtype}")
    else:
        raise ValueError(f"prompt embeddings must be float32, float16 or bfloat16, not {name}")
    if arr.ndim != 2:
        raise ValueError(f"prompt embeddings must be 2-D [rows, hidden], got shape {list(arr.shape)}")
    data = np.ascontiguousarray(arr, dtype=wire).tobytes()
    return EmbedsPrompt(dtype=name, shape=[int(n) for n in arr.shape], data=data)  # type: ignore[arg-type]


async def embeds_store(
    js: JetStreamContext, names: Names, *, ttl: float, replicas: int | None = None
) -> ObjectStore:
    """The namespace's embeddings object store, created on first use. Objects expire after `ttl`
    seconds (the job queue's max_age: no job can need one longer). `replicas` None follows the
    namespace (subjects/setup.py)."""
    return await ensure_bucket(
        js,
        ObjectStoreConfig(
            bucket=names.embeds_store,
            ttl=ttl,
            replicas=replicas or await namespace_replicas(js, names),
            storage=StorageType.FILE,
            description="jetllm prompt embeddings too big for a job message",
        ),
    )


async def upload(store: Any, name: str, prompt: EmbedsPrompt) -> EmbedsPrompt:
    """Put an inline prompt's bytes into the store; returns the reference that replaces it."""
    assert prompt.data is not None
    data = prompt.data
    digest = await anyio.to_thread.run_sync(lambda: hashlib.sha256(data).hexdigest())
    meta = ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=CHUNK_SIZE))
    await store.put(name, data, meta=meta)
    return EmbedsPrompt(dtype=prompt.dtype, shape=prompt.shape, object=name, sha256=digest)
