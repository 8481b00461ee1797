"""Same-host KV transfer through shared memory: a DATA message's payload never crosses the transport. Only its
header travels (over UCX, as every message does), naming where the payload lies: an ShmRef (kv_transfer/wire.py).
Two places it can lie, both memfds that receiving agents on the same host map read-only:
  - the sender's KV store itself (a prefill replica's: AgentFactory.share_kv_store), for a message whose source
    blocks are one run: the receiver copies them straight into its own blocks, the only copy of the transfer.
    The blocks must not change until the receiver has read them: PrefillConnector holds them past the
    request's end (LLMEngine.hold_blocks_after) until the transfer's ACK; when it ends otherwise, until every
    receiver sent refs has answered (after its ACK of any status it reads nothing more), or at the latest until
    the receivers' lease and a grace period are over (a receiver reads nothing past its lease);
  - the sender's staging buffer, for any other message: the sender gathers the payload into a slot, the
    receiver copies it out into its blocks, and the sender keeps the slot until that destination rank
    acknowledges the transfer (see Reuse).

Who may use it. A receiving agent advertises its domain, the host's boot id, its PID namespace and its user
(domain()), in the descriptors it hands out (TransferDescriptor.shm_domains); a sending agent sends by reference
only to a rank whose domain equals its own. There the receiver can open the sender's memfd as
/proc/<pid>/fd/<fd>: same kernel, same PID namespace, same user. Everywhere else (another host, another
container, another user, a CUDA store, a platform other than Linux on x86-64) messages carry their payload.

Trust. The header, ref included, carries the cluster's MAC, so only an agent holding the secret can point a
receiver at memory; the payload itself is not hashed (that pass cost more than the copy: docs/BENCHMARKS.md). A
memfd has no name in any filesystem and is reachable only through the sending process (ptrace-level access:
its own user, or root), which could change the payload in its own memory anyway. A receiver that maps a prefill
rank's store can read all of it: every tenant's KV on that rank, as the cluster's decode replicas receive every
tenant's KV anyway. The segment begins with a nonce the ref must name, so a reused fd number or PID is refused,
not read.

Reuse (staging slots). A slot goes back to the sender's pool once its destination rank acknowledged the transfer (it has
read every slot by then). When a transfer ends any other way, a receiver may still be reading, so the sender
first clears the slot's stamp: each send by reference writes a fresh stamp (a counter, never 0) into the 8 bytes
before the payload, and the ref names it. The receiver reads the stamp after its copy and fails the transfer
if it changed: the sender cleared it before reusing any byte, and x86-64 keeps both the sender's stores and the
receiver's loads in order (which is why the path is limited to x86-64). Only that slot's reader is affected,
never a read of another transfer.

The receiver keeps its mappings of senders' segments in a small LRU (MAX_MAPPINGS), dropping those whose process
is gone.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import struct
import warnings
from collections import OrderedDict

import numpy as np

from tandem.kv_transfer.wire import ShmRef

HEADER_PAGE = 4096  # the segment's first page: magic, nonce; slots start after it
_SEGMENT = struct.Struct("<4s4x16s")  # magic, nonce
_MAGIC = b"TKVS"
STAMP_BYTES = 8  # before each payload sent by reference
MAX_MAPPINGS = 16


class ShmUnavailable(RuntimeError):
    """A sender's segment could not be mapped or read as a ref names it."""


def domain() -> str:
    """This process's shared-memory domain ("" where the path is off: not Linux on x86-64, or /proc unreadable).
    Two agents with the same non-empty domain can map each other's memfds."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{pid_ns}/{os.geteuid()}"


class SharedSegment:
    """Bytes in a memfd that same-host receivers may map: a sending agent's staging (`buffer`, uint8, nbytes, is
    what its StagingPool carves) or a prefill rank's KV store (PagedKVCache's host memory)."""

    def __init__(self, nbytes: int):
        """Raises OSError where memfds cannot be made or sized (the agent then stages in private memory)."""
        self.nonce = secrets.token_bytes(16)
        self.fd = os.memfd_create("tandem-kv-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, HEADER_PAGE + nbytes)
            self._map = mmap.mmap(self.fd, HEADER_PAGE + nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        whole = np.frombuffer(self._map, dtype=np.uint8)
        whole[:_SEGMENT.size] = np.frombuffer(_SEGMENT.pack(_MAGIC, self.nonce), dtype=np.uint8)
        self.buffer = whole[HEADER_PAGE:]
        self.pid = os.getpid()
        self._stamps = 0

    def ref(self, offset: int, length: int) -> ShmRef:
        """Where buffer[offset:offset + length] lies, for a receiver in this domain, under a fresh stamp written
        into buffer[offset - STAMP_BYTES:offset] (offset must leave room for it: a slot's header bytes do)."""
        if offset < STAMP_BYTES or offset % STAMP_BYTES:
            raise ValueError(f"a payload at {offset} leaves no aligned room for its stamp")
        self._stamps += 1
        self._stamp_at(offset)[0] = self._stamps
        return ShmRef(self.pid, self.fd, self.nonce, HEADER_PAGE + offset, length, self._stamps)

    def clear(self, offset: int) -> None:
        """Clears the stamp of the payload at offset: before its slot goes back unacknowledged (a receiver still
        reading it then refuses what it read)."""
        self._stamp_at(offset)[0] = 0

    def _stamp_at(self, offset: int) -> np.ndarray:
        return self.buffer[offset - STAMP_BYTES:offset].view(np.uint64)

    def close(self) -> None:
        """Closes the fd (receivers can no longer open the segment; their mappings and ours stay valid)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PeerSegments:
    """A receiving agent's read-only mappings of senders' segments, by (pid, fd, nonce)."""

    def __init__(self, max_mappings: int = MAX_MAPPINGS):
        self.max_mappings = max_mappings
        self._maps: OrderedDict[tuple[int, int, bytes], np.ndarray] = OrderedDict()

    def view(self, ref: ShmRef) -> np.ndarray:
        """The read-only bytes ref names. Raises ShmUnavailable (the segment cannot be opened, is not the one
        the ref names, or is shorter than the ref reaches)."""
        return self._stamped(ref)[ref.offset:ref.offset + ref.length]

    def _stamped(self, ref: ShmRef) -> np.ndarray:
        """The whole segment ref names, once its payload and the stamp before it are checked to lie inside."""
        whole = self._segment(ref)
        if (ref.offset < HEADER_PAGE + STAMP_BYTES or ref.offset % STAMP_BYTES or
                ref.offset + ref.length > len(whole)):
            raise ShmUnavailable(f"a ref to bytes {ref.offset}-{ref.offset + ref.length} of a segment of "
                                 f"{len(whole)}")
        return whole

    def store_slice(self, ref: ShmRef, shape: tuple[int, int, int, int]) -> np.ndarray:
        """The read-only slice of a sender's KV store a ref names (ref.in_store), as uint8 [layers, K|V, blocks,
        bytes of the KV heads x block_size x head_dim] with the ref's strides. Raises ShmUnavailable as view()
        does, and for strides that are not positive or a slice that leaves the segment."""
        whole = self._segment(ref)
        layers, halves, blocks, inner = shape
        if min(ref.strides) <= 0 or ref.length != layers * halves * blocks * inner:
            raise ShmUnavailable(f"a store ref with strides {ref.strides} and {ref.length} bytes for a slice "
                                 f"{shape}")
        last = ref.offset + sum((n - 1) * s for n, s in zip((layers, halves, blocks), ref.strides)) + inner
        if ref.offset < HEADER_PAGE or last > len(whole):
            raise ShmUnavailable(f"a store ref to bytes {ref.offset}-{last} of a segment of {len(whole)}")
        return np.lib.stride_tricks.as_strided(whole[ref.offset:], shape=shape, strides=(*ref.strides, 1),
                                               writeable=False)

    def still_valid(self, ref: ShmRef) -> bool:
        """Whether the stamp before ref's payload is still ref's (asked after copying the payload out)."""
        whole = self._stamped(ref)
        return int(whole[ref.offset - STAMP_BYTES:ref.offset].view(np.uint64)[0]) == ref.stamp

    def _segment(self, ref: ShmRef) -> np.ndarray:
        key = (ref.pid, ref.fd, ref.nonce)
        whole = self._maps.get(key)
        if whole is not None:
            self._maps.move_to_end(key)
            return whole
        self._evict()
        path = f"/proc/{ref.pid}/fd/{ref.fd}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise ShmUnavailable(f"cannot open the sender's staging segment {path}: {e}") from e
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_PAGE:
                raise ShmUnavailable(f"{path} is {size} bytes, not a staging segment")
            mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except OSError as e:
            raise ShmUnavailable(f"cannot map the sender's staging segment {path}: {e}") from e
        finally:
            os.close(fd)
        whole = np.frombuffer(mapped, dtype=np.uint8)
        magic, nonce = _SEGMENT.unpack(whole[:_SEGMENT.size].tobytes())
        if magic != _MAGIC or nonce != ref.nonce:
            raise ShmUnavailable(f"{path} is not the staging segment the message names (pid or fd reused)")
        self._maps[key] = whole
        return whole

    def _evict(self) -> None:
        """Drops mappings of senders that exited, then the least recently used beyond max_mappings - 1."""
        for key in [k for k in self._maps if not os.path.exists(f"/proc/{k[0]}")]:
            del self._maps[key]
        while len(self._maps) >= self.max_mappings:
            self._maps.popitem(last=False)


_READ_ONLY_WARNING = "The given NumPy array is not writable"


def readable(view: np.ndarray):
    """A torch tensor over a read-only mapping, without torch's warning that it cannot write to it (the copy
    out of it never does). The warning is filtered for the process on first use: a catch_warnings block per
    message would cost every message a filter-list rebuild, and is not thread-safe."""
    import torch

    if not any(f[1] is not None and f[1].pattern == _READ_ONLY_WARNING for f in warnings.filters):
        warnings.filterwarnings("ignore", message=_READ_ONLY_WARNING)
    return torch.from_numpy(view)
