"""Transfer settings, parsed once at the entry point (the manifest's `transport` section in later issues)."""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field

from tandem.kv_transfer.wire import MIN_SECRET_BYTES

# Measured on the 2-core CI machine (docs/BENCHMARKS.md): 1 MiB TCP segments move about 4x more over loopback
# than UCX's 8 KB default.
DEFAULT_UCX_ENV = {
    "UCX_TCP_TX_SEG_SIZE": "1M",
    "UCX_TCP_RX_SEG_SIZE": "1M",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}


@dataclass(frozen=True)
class TransferConfig:
    """host: the address peers reach this host's agents at; port 0 picks free ports. layer_group: layers per
    message when sending as layers are computed (1: each layer leaves as soon as it is written); KV sent after
    the fact goes with all of a piece's layers per message.
    max_message_bytes caps a message (larger pieces go as runs of blocks). staging_bytes: each agent's
    reusable buffer for messages in flight (registered once); a message that finds it full waits (receiving)
    or takes a one-off buffer (sending, counted in stats). lease_s: how long a reservation waits for its data.
    tombstone_s: how long a finished transfer is remembered, to answer late messages with its outcome.
    kv_path: how message bytes leave and reach a KV store. "staged": through host staging (pinned beside a CUDA
    store; the copies to and from the device run on the agent's own CUDA streams). "direct": through
    device-side staging slots the transport sends and receives as they are (needs a transport that moves CUDA
    memory itself; beside a CPU store the slots are torch host tensors, which runs this path without a GPU).
    "auto": direct when the store is on a CUDA device and the transport reports a transport that moves
    device memory between processes (UCX: cuda_ipc, or RDMA with GPUDirect), else staged. Direct staging
    takes staging_bytes of device memory and as much pinned host memory (the header and MAC are computed on
    a host copy). A receiver drops DATA messages longer than its own max_message_bytes (plus a header): both
    sides must agree on it, as every replica of one manifest does.

    shared_memory (opt-in): between agents of one host (same kernel, PID namespace and user; KV stores on the
    CPU, on Linux x86-64), DATA messages travel by reference: the payload stays in the sender's staging, which lives in
    shared memory, and only the header crosses the transport (kv_transfer/shm.py). False: every payload is
    sent through the transport. send_all waits up to room_wait_s for a shared staging slot to free up before it
    sends a message through the transport instead.

    secret: the key every message's MAC is made under (kv_transfer/wire.py); agents with different secrets
    cannot talk. A cluster generates one at start and hands it to every replica through Ray (never a command
    line, never a log line: it is left out of repr). The default is fresh random bytes per TransferConfig
    object: agents built from one config object (or copies of it) talk to each other, and to no one else."""

    transport: str = "ucx"  # "ucx" | "fake" (in-process, tests)
    host: str = "127.0.0.1"
    port: int = 0
    layer_group: int = 1
    max_message_bytes: int = 16 << 20
    staging_bytes: int = 128 << 20
    lease_s: float = 30.0
    tombstone_s: float = 120.0
    idle_poll_s: float = 0.002
    kv_path: str = "auto"  # "auto" | "staged" | "direct"
    shared_memory: bool = False
    room_wait_s: float = 0.5
    ucx_env: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_UCX_ENV))
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    def on_host(self, host: str) -> TransferConfig:
        """This config with the address peers reach this host's agents at."""
        return dataclasses.replace(self, host=host)

    def __post_init__(self) -> None:
        if self.transport not in ("ucx", "fake"):
            raise ValueError(f"transport must be 'ucx' or 'fake', got {self.transport!r}")
        if self.kv_path not in ("auto", "staged", "direct"):
            raise ValueError(f"kv_path must be 'auto', 'staged' or 'direct', got {self.kv_path!r}")
        if self.layer_group < 1:
            raise ValueError(f"layer_group must be at least 1, got {self.layer_group}")
        if self.max_message_bytes < 4096:
            raise ValueError(f"max_message_bytes must be at least 4096, got {self.max_message_bytes}")
        if self.staging_bytes < 2 * self.max_message_bytes:
            raise ValueError(f"staging_bytes ({self.staging_bytes}) must hold at least two messages of "
                             f"max_message_bytes ({self.max_message_bytes})")
        if not isinstance(self.secret, bytes) or len(self.secret) < MIN_SECRET_BYTES:
            raise ValueError(f"secret must be at least {MIN_SECRET_BYTES} bytes")  # never show its value
        for name in ("lease_s", "tombstone_s", "idle_poll_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.room_wait_s < 0:
            raise ValueError(f"room_wait_s must not be negative, got {self.room_wait_s}")
