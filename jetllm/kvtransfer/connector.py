"""jetllm's KV connector for vLLM (v1 interface), loaded by module path inside the engine.

It only copies whole blocks between the engine's KV cache and block files in one private
directory; the worker around the engine moves those files through NATS (transport.py). So no
network, thread or retry lives in the engine's processes, and everything about the transfer
(checks, time-outs, the fallback to a local prefill) is the worker's, in plain asyncio code.

The worker asks per request through `kv_transfer_params`:
  {"jetllm_save": "<name>.kv", "jetllm_checksum": "blake3-128"}  (prefill) write the prompt's full
      blocks once they are computed, with each block's checksum taken as it is written;
  {"jetllm_load": "<name>.kv"}  (decode) take the prompt's first tokens from that file.
At least the prompt's last token is always computed by the engine itself (it needs its logits),
so a file covers the full blocks of all but the last prompt token. Layout (layers, dtype, block
shape, where the block dimension sits) comes from the engine's own tensors, never from config.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..schemas.disagg import KvBlocksHeader, KvLayer
from . import blockfile
from .params import CHECKSUM, LOAD, SAVE, full_block_tokens

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[0-9a-f]{16,64}\.kv$")


def _checksum(params: dict[str, Any]) -> str | None:
    """The checksum a save asks for, if this engine can take it (else the publisher takes it)."""
    algorithm = params.get(CHECKSUM)
    if not isinstance(algorithm, str):
        return None
    try:
        blockfile.checksummer(algorithm)
    except blockfile.BadBlockFile:
        return None
    return algorithm


@dataclass
class _Save:
    name: str
    num_tokens: int
    digest: str
    checksum: str | None
    blocks: list[int] = field(default_factory=list)


@dataclass
class _Load:
    name: str
    skip: int
    """Leading blocks the engine already had (its own prefix cache): not overwritten."""
    num_blocks: int


@dataclass
class SaveOrder:
    req_id: str
    name: str
    block_ids: list[int]
    num_tokens: int
    digest: str
    checksum: str | None


@dataclass
class LoadOrder:
    req_id: str
    name: str
    first: int
    block_ids: list[int]


@dataclass
class JetllmKvMeta(KVConnectorMetadata):
    saves: list[SaveOrder] = field(default_factory=list)
    loads: list[LoadOrder] = field(default_factory=list)


class JetllmKvConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._dir = Path(self._kv_transfer_config.get_from_extra_config("block_dir", "")).resolve()
        if not self._dir.is_dir():
            raise ValueError(f"kv_connector_extra_config.block_dir {str(self._dir)!r} is not a directory")
        self._saves: dict[str, _Save] = {}
        self._loads: dict[str, _Load] = {}
        self._caches: dict[str, torch.Tensor] = {}
        self._layers: list[KvLayer] = []
        self._load_errors: set[int] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # saves are written within the step that computes the blocks

    def _path(self, name: Any) -> Path | None:
        if not isinstance(name, str) or not _NAME.match(name):
            log.warning("jetllm connector: refusing block file name %r", name)
            return None
        return self._dir / name

    # scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        prompt = list(request.prompt_token_ids or [])
        if SAVE in params and self._path(params[SAVE]) is not None:
            n = full_block_tokens(len(prompt), self._block_size)
            if n:
                digest = blockfile.prompt_digest(prompt[:n])
                self._saves[request.request_id] = _Save(params[SAVE], n, digest, _checksum(params))
            return 0, False
        path = self._path(params[LOAD]) if LOAD in params else None
        if path is None:
            return 0, False
        try:
            header, _ = blockfile.read_header(path)
        except (OSError, blockfile.BadBlockFile) as exc:
            log.warning("jetllm connector: %s: %s; computing the prompt", request.request_id, exc)
            return 0, False
        n = header.num_tokens
        if header.block_size != self._block_size or n > full_block_tokens(len(prompt), self._block_size):
            log.warning("jetllm connector: %s: blocks do not fit this engine or prompt", request.request_id)
            return 0, False
        if header.prompt_digest != blockfile.prompt_digest(prompt[:n]):
            log.warning("jetllm connector: %s: blocks are of another prompt", request.request_id)
            return 0, False
        if n <= num_computed_tokens:
            return 0, False
        skip = num_computed_tokens // self._block_size
        self._loads[request.request_id] = _Load(params[LOAD], skip, header.num_blocks)
        return n - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        if num_external_tokens == 0:
            self._loads.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = JetllmKvMeta()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            rid = new.req_id
            load = self._loads.pop(rid, None)
            if load is not None:
                ids = new.block_ids[0][load.skip : load.num_blocks]
                meta.loads.append(LoadOrder(rid, load.name, load.skip, list(ids)))
            save = self._saves.get(rid)
            if save is not None:
                save.blocks = list(new.block_ids[0])
                self._due(rid, new.num_computed_tokens + scheduled.get(rid, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            save = self._saves.get(rid)
            if save is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if rid in cached.resumed_req_ids:
                    save.blocks = list(new_ids[0])
                else:
                    save.blocks.extend(new_ids[0])
            self._due(rid, cached.num_computed_tokens[i] + scheduled.get(rid, 0), meta)
        return meta

    def _due(self, rid: str, computed_after_step: int, meta: JetllmKvMeta) -> None:
        save = self._saves[rid]
        if computed_after_step >= save.num_tokens:
            n_blocks = save.num_tokens // self._block_size
            meta.saves.append(
                SaveOrder(rid, save.name, save.blocks[:n_blocks], save.num_tokens, save.digest, save.checksum)
            )
            del self._saves[rid]

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._saves.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return False, None

    # worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        layers = []
        for name, t in kv_caches.items():
            dims = [d for d, size in enumerate(t.shape) if size == num_blocks]
            if not dims:
                raise ValueError(
                    f"jetllm connector: no block dimension of size {num_blocks} in {name} {t.shape}"
                )
            d = dims[0]
            shape = [s for i, s in enumerate(t.shape) if i != d]
            layers.append(
                KvLayer(name=name, dtype=str(t.dtype).removeprefix("torch."), block_shape=shape, block_dim=d)
            )
        self._caches = dict(kv_caches)
        self._layers = layers
        log.info(
            "jetllm connector: %d KV tensors, block dim %s, %d bytes per block",
            len(layers),
            sorted({x.block_dim for x in layers}),
            self._block_bytes(),
        )

    def _layer_bytes(self, layer: KvLayer) -> int:
        return math.prod(layer.block_shape) * getattr(torch, layer.dtype).itemsize

    def _block_bytes(self) -> int:
        return sum(self._layer_bytes(x) for x in self._layers)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, JetllmKvMeta)
        for order in meta.saves:
            try:
                self._save(order)
            except Exception:  # the decode worker then finds no file and computes the prompt
                log.exception("jetllm connector: saving blocks of %s failed", order.req_id)

    def _save(self, order: SaveOrder) -> None:
        idx = torch.tensor(order.block_ids, dtype=torch.long)
        per_layer = []
        for layer in self._layers:
            t = self._caches[layer.name]
            picked = t.index_select(layer.block_dim, idx).movedim(layer.block_dim, 0).contiguous()
            per_layer.append(picked.reshape(len(order.block_ids), -1).view(torch.uint8).numpy())
        header = KvBlocksHeader(
            block_size=self._block_size,
            num_tokens=order.num_tokens,
            num_blocks=len(order.block_ids),
            block_bytes=self._block_bytes(),
            prompt_digest=order.digest,
            layers=self._layers,
        )
        blocks = (b"".join(a[j].tobytes() for a in per_layer) for j in range(len(order.block_ids)))
        blockfile.write(self._dir / order.name, header, blocks, checksum=order.checksum)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, JetllmKvMeta)
        for order in meta.loads:
            try:
                self._load(order)
            except Exception as exc:  # vLLM recomputes the blocks reported here
                log.warning("jetllm connector: loading blocks of %s failed: %s", order.req_id, exc)
                self._load_errors.update(order.block_ids)

    def _load(self, order: LoadOrder) -> None:
        path = self._dir / order.name
        header, offset = blockfile.read_header(path)
        if [(x.name, x.dtype, x.block_shape, x.block_dim) for x in header.layers] != [
            (x.name, x.dtype, x.block_shape, x.block_dim) for x in self._layers
        ]:
            raise blockfile.BadBlockFile("blocks were written by an engine with another KV layout")
        k = len(order.block_ids)
        if order.first + k > header.num_blocks:
            raise blockfile.BadBlockFile(
                f"file holds {header.num_blocks} blocks, {order.first + k} asked for"
            )
        data = np.fromfile(
            path,
            dtype=np.uint8,
            offset=offset + order.first * header.block_bytes,
            count=k * header.block_bytes,
        ).reshape(k, header.block_bytes)
        dst = torch.tensor(order.block_ids, dtype=torch.long)
        start = 0
        for layer in self._layers:
            size = self._layer_bytes(layer)
            raw = torch.from_numpy(np.ascontiguousarray(data[:, start : start + size]))
            src = raw.view(getattr(torch, layer.dtype)).reshape(k, *layer.block_shape)
            t = self._caches[layer.name]
            t.index_copy_(layer.block_dim, dst, src.movedim(0, layer.block_dim))
            start += size

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
