"""The types both sides of a transfer share: its states, the KV format, the descriptor the decode side hands out
when it reserves blocks (the prefill side pushes into it), and the error a replica raises when a transfer ends
badly. Plain Python: the router imports these without the model runtime."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tandem.engine.errors import TandemError
from tandem.engine.parallel.layout import ReplicaLayout

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "fp8_e4m3": 1}
KV_DTYPES = tuple(_DTYPE_BYTES)  # a KV store's dtype names (engine/kv/kv_cache.py KV_STORAGE); the wire codes them
QUANTIZED_KV_DTYPES = ("int8", "fp8_e4m3")  # stores that keep a scale row per block and KV head


class TransferState(enum.Enum):
    """RESERVED -> TRANSFERRING -> DONE | FAILED | EXPIRED | ABORTED, on each side and for each rank.

    RESERVED: decode side: blocks held, nothing arrived; prefill side: armed, nothing sent. TRANSFERRING: bytes
    moving. DONE: every message arrived and verified (decode) / was acknowledged as such (prefill). FAILED: a
    connection error, a dead peer, or an authentic message that does not fit the reservation (a message that
    fails its MAC is dropped and changes nothing). EXPIRED: the lease deadline passed first. ABORTED:
    either side gave up (cancelled request). The last four are terminal: on the decode side the reserved
    blocks are free again by then, and nothing writes into them any more."""

    RESERVED = "reserved"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self not in (TransferState.RESERVED, TransferState.TRANSFERRING)


@dataclass(frozen=True)
class KVFormat:
    """What both replicas' KV stores must agree on for bytes to be copied as they are. Stores of different
    dtypes still exchange KV: the receiver converts what arrives (each message names its dtype)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # one of KV_DTYPES

    @property
    def rows_per_block(self) -> int:
        """Rows of head_dim elements per block, layer, K/V and KV head: the tokens and a quantized store's scales."""
        return self.block_size + (1 if self.dtype in QUANTIZED_KV_DTYPES else 0)

    @property
    def bytes_per_block_layer_head(self) -> int:
        """K and V of one block of one layer and one KV head (with their scales in a quantized store)."""
        return 2 * self.rows_per_block * self.head_dim * _DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> float:
        """Bytes of every layer's and KV head's K and V per token (scales shared out over the block's tokens)."""
        return self.num_layers * self.num_kv_heads * self.bytes_per_block_layer_head / self.block_size

    @property
    def largest_bytes_per_block_layer_head(self) -> int:
        """What one block of one layer and KV head takes in the widest dtype a peer may send it in."""
        return max(KVFormat(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, d)
                   .bytes_per_block_layer_head for d in KV_DTYPES)

    def with_dtype(self, dtype: str) -> KVFormat:
        if dtype not in KV_DTYPES:
            raise ValueError(f"unknown KV dtype {dtype!r}; known: {', '.join(KV_DTYPES)}")
        return KVFormat(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, dtype)

    def check_matches(self, other: KVFormat, *, dtype: bool = True) -> None:
        """Raises ValueError naming the first field that differs (dtype False: all but the dtype, which the
        receiver converts)."""
        names = ("num_layers", "num_kv_heads", "head_dim", "block_size") + (("dtype",) if dtype else ())
        for name in names:
            if getattr(self, name) != getattr(other, name):
                raise ValueError(f"KV formats differ in {name}: {getattr(self, name)} here, "
                                 f"{getattr(other, name)} at the peer")


@dataclass(frozen=True)
class TransferDescriptor:
    """Issued by the decode side for one request: where to push (one agent address per destination rank),
    into which blocks (the same ids on every destination rank, in token order), and until when (a wall-clock
    deadline, time.time() seconds: the lease; after it the blocks are freed and late data is refused).
    shm_domains: each destination rank's shared-memory domain ("" or missing: none); a source rank in the same
    domain sends it payloads by reference (kv_transfer/shm.py). lora: the LoRA adapter the blocks were reserved
    for (None: the base model); a sender computing under another one is refused (PrefillConnector.submit)."""

    transfer_id: str
    layout: ReplicaLayout
    addresses: tuple[str, ...]
    block_ids: tuple[int, ...]
    num_tokens: int
    kv: KVFormat
    deadline: float
    shm_domains: tuple[str, ...] = ()
    lora: str | None = None

    def shm_domain(self, rank: int) -> str:
        return self.shm_domains[rank] if rank < len(self.shm_domains) else ""


@dataclass(frozen=True)
class RankStatus:
    """One rank's view of one transfer: its state, payload bytes moved so far, and why it ended badly."""

    state: TransferState
    nbytes: int = 0
    error: str | None = None


class TransferFailedError(TandemError, RuntimeError):
    """A request's KV transfer ended FAILED, EXPIRED or ABORTED; its blocks are free on the side that raised it.
    Raised by PrefillReplicaAPI.prefill and DecodeReplicaAPI.decode (replica/contract.py)."""

    def __init__(self, request_id: str, state: TransferState, error: str | None):
        self.request_id, self.state, self.error = request_id, state, error
        super().__init__(f"KV transfer of request {request_id!r} {state.value}: {error or 'no detail'}")

    def __reduce__(self):  # crosses process boundaries (Ray) with its fields
        return type(self), (self.request_id, self.state, self.error)
