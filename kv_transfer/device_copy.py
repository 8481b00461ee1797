"""Copies between a rank's paged KV store and message bytes, on whatever device the store lives on.

A payload is the slice a plan Message names, [layers, K|V, blocks, KV heads, block_size, head_dim] in the
store's dtype, as raw bytes; gather and scatter move bytes, never values (a NaN's bits arrive as they left).

Beside a CPU store every copy is synchronous: gather is one index_select into the host slot, scatter one
index_copy_ out of it; where the block ids are one ascending run (a freshly allocated request's usually are) both
are a plain strided copy of that run instead (18 against 11 GB/s on one core of the CI machine, into private
memory).

Beside a CUDA store the copier owns two streams, one per side:
  - send stream (the caller's thread: the runner's layer hook or the driver): gather_into queues index_select
    after the work already queued on the caller's current stream (the layers just computed), then a
    non_blocking copy into the pinned host slot, and records an event. The returned PendingCopy's wait() blocks
    on that event, so the agent can start message i+1's copy before it seals and sends message i.
  - receive stream (the agent's pump thread): scatter_from copies a host payload to the device (non_blocking,
    from pinned memory) and index_copy_s it into the blocks; it returns only once the stream is synchronised,
    so a block is never reported complete before its bytes are in place.
Host staging memory comes from host_buffer (pinned beside a CUDA store: asynchronous copies need page-locked
memory); device-side staging slots, for transports that send device memory themselves, from device_buffer.
Which of the two an agent's messages travel through (its path) is chosen once, by choose_path.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch

from tandem.engine.attention.kv_quant import convert_blocks
from tandem.engine.kv.kv_cache import scale_rows

_log = logging.getLogger(__name__)


def _run_start(ids: list[int]) -> int | None:
    """ids[0] when ids are consecutive ascending block ids (a slice of the store), else None."""
    first = ids[0]
    return first if ids == list(range(first, first + len(ids))) else None


class PendingCopy:
    """A copy the copier started. wait() returns once its bytes are in place (at once for a CPU store); until
    then the buffers it reads or writes must stay untouched."""

    __slots__ = ("_event", "_keep")

    def __init__(self, event: torch.cuda.Event | None = None, keep: tuple = ()):
        self._event = event
        self._keep = keep  # the temporaries the queued copy uses, held until it has run

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        self._keep = ()


class KVCopier:
    def __init__(self, data: torch.Tensor, layers: range, kv_heads: range):
        """data: a rank's KV store [layers, 2, blocks, KV heads, rows, head_dim] holding the global layers
        `layers` and KV heads `kv_heads` (rows: block_size, plus a quantized store's scale row). Payloads name
        global layers and heads; block ids are this store's. Copies move the store as machine words (int64 where
        a row's bytes allow), whatever its dtype: torch's CPU index ops skip float8, and copying a 1-byte dtype
        element by element costs about a third more per byte than words."""
        if data.dim() != 6 or data.shape[0] != len(layers) or data.shape[3] != len(kv_heads):
            raise ValueError(f"a KV store of shape {tuple(data.shape)} does not hold {len(layers)} layers x "
                             f"{len(kv_heads)} KV heads as [layers, 2, blocks, KV heads, rows, head_dim]")
        self.store_dtype = data.dtype
        self.block_size = data.shape[4] - scale_rows(data.dtype)
        self.head_dim = data.shape[5]
        row_bytes = data.shape[5] * data.element_size()
        word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if row_bytes % w.itemsize == 0)
        self.data = data.view(word)
        self.layers, self.kv_heads = layers, kv_heads
        self.device = data.device
        self.on_cuda = data.device.type == "cuda"
        self._send_stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self._receive_stream = torch.cuda.Stream(self.device) if self.on_cuda else None

    def choose_path(self, wanted: str, device_transports: tuple[str, ...], rank: int) -> str:
        """"staged" or "direct" for TransferConfig.kv_path `wanted`, given the transport's device_transports;
        logged once (as rank's). Raises ValueError for "direct" beside a CUDA store when the transport cannot
        move device memory."""
        carriers = device_transports if self.on_cuda else ()
        if wanted == "direct" and self.on_cuda and not carriers:
            raise ValueError(f"kv_path='direct' needs a transport that moves CUDA memory between processes; "
                             f"this one reports none (UCX: no cuda_ipc, no RDMA with GPUDirect here). "
                             f"Use kv_path='staged' or 'auto'")
        path = "direct" if wanted == "direct" or (wanted == "auto" and carriers) else "staged"
        _log.info("rank %d: KV store on %s, %s transfers (device transports: %s)", rank, self.device, path,
                  ", ".join(carriers) or "none")
        return path

    # -- buffers -------------------------------------------------------------------------------------------

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """nbytes of host memory for staging (uint8): pinned beside a CUDA store, plain numpy beside a CPU one."""
        if self.on_cuda:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()  # the array keeps it alive
        return np.empty(nbytes, dtype=np.uint8)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        """nbytes (uint8) on the store's device: a device-side staging buffer (a host tensor beside a CPU store)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    # -- copies --------------------------------------------------------------------------------------------

    def gather_into(self, payload: np.ndarray, layers: range, kv_heads: range, block_ids: Sequence[int],
                    device_payload: torch.Tensor | None = None) -> PendingCopy:
        """Starts copying the K/V of block_ids (in payload order; repeats allowed) for the global layers x
        kv_heads into payload (host bytes of exactly that slice). With device_payload (bytes on the store's
        device: a device-side staging slot) the slice is gathered there and payload gets a copy of it, for the
        MAC. Call wait() on the result before reading payload or handing device_payload on. Raises
        ValueError for a slice this store does not hold, a payload of another size, or a block id out of range."""
        host = torch.from_numpy(payload)
        source = self._region(layers, kv_heads)
        ids = self._check_blocks(block_ids)
        if not self.on_cuda:
            into = self._shaped(host if device_payload is None else device_payload, layers, kv_heads, len(ids))
            if (start := _run_start(ids)) is not None:
                into.copy_(source.narrow(2, start, len(ids)))
            else:
                torch.index_select(source, 2, self._rows(ids), out=into)
            if device_payload is not None:
                host.copy_(device_payload)
            return PendingCopy()
        stream = self._send_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the writes of these layers come first
        with torch.cuda.stream(stream):
            rows = self._rows(ids)
            if device_payload is None:
                self._shaped(host, layers, kv_heads, len(ids))  # checks the size before anything is queued
                gathered = torch.index_select(source, 2, rows).view(-1).view(torch.uint8)
            else:
                torch.index_select(source, 2, rows, out=self._shaped(device_payload, layers, kv_heads, len(ids)))
                gathered = device_payload
            host.copy_(gathered, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return PendingCopy(done, (rows, gathered, host))

    def scatter_from(self, payload: np.ndarray | torch.Tensor, layers: range, kv_heads: range,
                     block_ids: Sequence[int]) -> None:
        """Writes payload (the bytes of the slice global layers x kv_heads x block_ids: host bytes, or bytes on
        the store's device) into block_ids (this store's ids, in payload order). Returns once the blocks hold
        the bytes. Raises ValueError for a slice this store does not hold, a payload of another size, or block
        ids that repeat (which copy would win is undefined on a GPU) or are out of range."""
        ids = self._check_blocks(block_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"destination block ids repeat: {list(ids)}")
        source = torch.from_numpy(payload) if isinstance(payload, np.ndarray) else payload
        target = self._region(layers, kv_heads)
        if not self.on_cuda:
            self._scatter_shaped(target, self._shaped(source, layers, kv_heads, len(ids)), ids)
            return
        self._shaped(source, layers, kv_heads, len(ids))  # checks the size before anything is queued
        # After whatever this thread queued on the device before (a reused block's last reads, say).
        self._receive_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._receive_stream):
            rows = self._rows(ids)
            data = source if source.device == self.device else source.to(self.device, non_blocking=True)
            target.index_copy_(2, rows, self._shaped(data, layers, kv_heads, len(ids)))
        self._receive_stream.synchronize()

    def scatter_converted(self, payload: np.ndarray | torch.Tensor, dtype: torch.dtype, block_size: int,
                          layers: range, kv_heads: range, block_ids: Sequence[int]) -> None:
        """scatter_from for the slice as a store of another dtype holds it (payload: its bytes, or the slice
        itself, any strides): converted into this store's dtype first (engine/attention/kv_quant.py
        convert_blocks). Raises ValueError as scatter_from does."""
        if isinstance(payload, np.ndarray):
            payload = torch.from_numpy(payload)
        rows = block_size + scale_rows(dtype)
        shape = (len(layers), 2, len(block_ids), len(kv_heads), rows, self.head_dim)
        if payload.dtype == torch.uint8 and payload.dim() == 1:
            if payload.numel() != int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size():
                raise ValueError(f"a payload of {payload.numel()} bytes for a {dtype} slice {shape}")
            payload = payload.view(dtype).view(shape)
        elif tuple(payload.shape) != shape or payload.dtype != dtype:
            raise ValueError(f"a {payload.dtype} slice {tuple(payload.shape)} for a {dtype} slice {shape}")
        converted = convert_blocks(payload.to(self.device), block_size, self.store_dtype)
        self.scatter_from(converted.view(-1).view(torch.uint8), layers, kv_heads, block_ids)

    def scatter_slice(self, source: torch.Tensor, layers: range, kv_heads: range, block_ids: Sequence[int]) -> None:
        """Writes source, the slice [layers, 2, blocks, KV heads, block_size, head_dim] in the store's dtype (any
        strides: a peer's KV store mapped from shared memory), into block_ids of a CPU store. Raises ValueError
        as scatter_from does, or for a source of another shape."""
        ids = self._check_blocks(block_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"destination block ids repeat: {list(ids)}")
        rows = self.data.shape[4]
        shape = (len(layers), 2, len(ids), len(kv_heads), rows, self.head_dim)
        if self.on_cuda or tuple(source.shape) != shape or source.dtype != self.store_dtype:
            raise ValueError(f"a {source.dtype} slice {tuple(source.shape)} for {shape} of a {self.store_dtype} "
                             f"store on {self.device}")
        self._scatter_shaped(self._region(layers, kv_heads), source.view(self.data.dtype), ids)

    def _scatter_shaped(self, target: torch.Tensor, shaped: torch.Tensor, ids: list[int]) -> None:
        if (start := _run_start(ids)) is not None:
            target.narrow(2, start, len(ids)).copy_(shaped)
        else:
            target.index_copy_(2, self._rows(ids), shaped)

    def to_host(self, source: torch.Tensor, host: np.ndarray) -> None:
        """Copies device bytes into host bytes of the same length (a received device-side slot, to read its
        header and check its MAC); returns when done. Receiving side (the pump's thread, its stream)."""
        self._copy(torch.from_numpy(host), source, self._receive_stream)

    def to_device(self, host: np.ndarray, target: torch.Tensor) -> None:
        """Copies host bytes into device bytes of the same length (a message header into a device-side slot);
        returns when done. Sending side (the caller's thread, the send stream)."""
        self._copy(target, torch.from_numpy(host), self._send_stream)

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        """A float32 host copy of block_ids' K/V values: [layers, 2, blocks, KV heads, block_size, head_dim] (a
        quantized store's codes times their scales)."""
        rows = self._rows(self._check_blocks(block_ids))
        blocks = self.data.index_select(2, rows).view(self.store_dtype)
        return convert_blocks(blocks, self.block_size, torch.float32).cpu().numpy()

    def bind_thread(self) -> None:
        """Makes the store's GPU current on the calling thread with its primary CUDA context bound, for a
        thread that hands device memory to a transport before it runs any copy (UCX's CUDA transports work in
        the context current on the posting thread). Nothing beside a CPU store."""
        if self.on_cuda:
            torch.cuda.set_device(self.device)
            torch.cuda.synchronize(self.device)  # a runtime call: binds the primary context to this thread

    # -- helpers -------------------------------------------------------------------------------------------

    def _rows(self, ids: list[int]) -> torch.Tensor:
        """ids as an int64 index on the store's device, on the current stream. On a GPU it goes up from pinned
        memory without blocking: a copy from pageable memory would wait for everything queued on the stream."""
        rows = torch.tensor(ids, dtype=torch.int64)
        return rows if not self.on_cuda else rows.pin_memory().to(self.device, non_blocking=True)

    def _copy(self, target: torch.Tensor, source: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        if target.numel() != source.numel():
            raise ValueError(f"copy of {source.numel()} bytes into {target.numel()}")
        if stream is None:
            target.copy_(source)
            return
        with torch.cuda.stream(stream):
            target.copy_(source, non_blocking=True)
        stream.synchronize()

    def _region(self, layers: range, kv_heads: range) -> torch.Tensor:
        if not (self.layers.start <= layers.start < layers.stop <= self.layers.stop and
                self.kv_heads.start <= kv_heads.start < kv_heads.stop <= self.kv_heads.stop):
            raise ValueError(f"layers {layers.start}-{layers.stop - 1} x KV heads {kv_heads.start}-"
                             f"{kv_heads.stop - 1} are not all in this store (layers {self.layers.start}-"
                             f"{self.layers.stop - 1}, KV heads {self.kv_heads.start}-{self.kv_heads.stop - 1})")
        l0, h0 = layers.start - self.layers.start, kv_heads.start - self.kv_heads.start
        return self.data[l0:l0 + len(layers), :, :, h0:h0 + len(kv_heads)]

    def _check_blocks(self, block_ids: Sequence[int]) -> list[int]:
        """The ids as a list; out-of-range ids raise here (on a GPU they would fail inside a kernel, which
        poisons the whole CUDA context)."""
        ids = [int(b) for b in block_ids]
        num_blocks = self.data.shape[2]
        if not ids or min(ids) < 0 or max(ids) >= num_blocks:
            raise ValueError(f"block ids {ids[:8]}{'...' if len(ids) > 8 else ''} are not a non-empty list of "
                             f"blocks of a store of {num_blocks}")
        return ids

    def _shaped(self, buffer: torch.Tensor, layers: range, kv_heads: range, num_blocks: int) -> torch.Tensor:
        """buffer (uint8, contiguous) viewed as the slice [layers, 2, blocks, KV heads, rows, words] of the store's
        words (see __init__)."""
        _, _, _, _, rows, words = self.data.shape
        shape = (len(layers), 2, num_blocks, len(kv_heads), rows, words)
        nbytes = int(np.prod(shape)) * self.data.element_size()
        if buffer.numel() != nbytes:
            raise ValueError(f"a payload of {buffer.numel()} bytes for a slice of {nbytes}")
        return buffer.view(self.data.dtype).view(shape)
