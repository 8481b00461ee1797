"""Which source rank sends which slice of a request's KV to which destination rank, and in which messages.

Both replicas hold the same model's KV, split differently (engine/parallel/layout.py): a rank holds the layers
of its pipeline stage and the KV heads of its tensor-parallel index, and EP ranks of one stage hold the same
KV heads. The plan covers every (layer, KV head) of every destination rank exactly once:
  - a piece is a rectangle (layers x KV heads) that one source rank sends to one destination rank;
  - where several source ranks hold the same slice (EP replicas, KV heads replicated when tp > KV heads), the
    destination rank picks one by its rank number, so the sending work spreads over the replicas;
  - a message is a piece cut to one layer group (the unit of layer-wise pipelining: it is sent as soon as its
    last layer is computed) and, if still too large, to runs of blocks.

Plain Python over ints: the router and the tests read it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.parallel.layout import ReplicaLayout

MAX_MESSAGES = 4096  # a message's index fits 12 bits of its tag (kv_transfer/wire.py)


@dataclass(frozen=True)
class Piece:
    """Layers x KV heads (global indices) that src_rank sends to dst_rank."""

    src_rank: int
    dst_rank: int
    layers: range
    kv_heads: range


@dataclass(frozen=True)
class Message:
    """One wire message: a piece's layers x KV heads over the request's blocks [blocks.start, blocks.stop)
    (indices into the request's block table, not block ids). index is unique within a transfer."""

    index: int
    src_rank: int
    dst_rank: int
    layers: range
    kv_heads: range
    blocks: range

    def nbytes(self, bytes_per_block_layer_head: int) -> int:
        return len(self.layers) * len(self.kv_heads) * len(self.blocks) * bytes_per_block_layer_head


def check_compatible(src: ReplicaLayout, dst: ReplicaLayout) -> None:
    """Raises ValueError unless both layouts describe the same model's KV (layers and KV heads)."""
    if (src.num_layers, src.num_kv_heads) != (dst.num_layers, dst.num_kv_heads):
        raise ValueError(f"cannot transfer KV between models of different shapes: source has {src.num_layers} "
                         f"layers x {src.num_kv_heads} KV heads, destination {dst.num_layers} x {dst.num_kv_heads}")


def plan_pieces(src: ReplicaLayout, dst: ReplicaLayout) -> tuple[Piece, ...]:
    """Every destination rank's layers x KV heads, each (layer, head) from exactly one source rank, merged into
    as few rectangles as the two layouts allow. Raises ValueError for layouts of different models."""
    check_compatible(src, dst)
    src_shards = [src.shard(r) for r in range(src.world_size)]
    pieces: list[Piece] = []
    for d in range(dst.world_size):
        shard = dst.shard(d)
        rows: list[tuple[int, list[tuple[int, range]]]] = []  # (layer, [(source, heads)]) per layer
        for layer in shard.layers:
            segments: list[tuple[int, range]] = []
            for head in shard.kv_heads:
                holders = [s.rank for s in src_shards if layer in s.layers and head in s.kv_heads]
                source = holders[d % len(holders)]
                if segments and segments[-1][0] == source and segments[-1][1].stop == head:
                    segments[-1] = (source, range(segments[-1][1].start, head + 1))
                else:
                    segments.append((source, range(head, head + 1)))
            rows.append((layer, segments))
        start = 0
        for i in range(1, len(rows) + 1):  # merge consecutive layers with the same head segments
            if i == len(rows) or rows[i][1] != rows[start][1]:
                layers = range(rows[start][0], rows[i - 1][0] + 1)
                pieces.extend(Piece(source, d, layers, heads) for source, heads in rows[start][1])
                start = i
    return tuple(pieces)


def plan_messages(pieces: tuple[Piece, ...], num_blocks: int, *, layer_group: int, max_message_bytes: int,
                  bytes_per_block_layer_head: int) -> tuple[Message, ...]:
    """Cuts pieces into messages: at every multiple of layer_group (global layer index, so a message's layers
    are computed together) and then into runs of blocks of at most max_message_bytes. Raises ValueError if one
    block of one layer group exceeds max_message_bytes or the transfer needs more than MAX_MESSAGES."""
    if layer_group < 1:
        raise ValueError(f"layer_group must be at least 1, got {layer_group}")
    messages: list[Message] = []
    for piece in pieces:
        layer = piece.layers.start
        while layer < piece.layers.stop:
            end = min(piece.layers.stop, (layer // layer_group + 1) * layer_group)
            per_block = (end - layer) * len(piece.kv_heads) * bytes_per_block_layer_head
            if per_block > max_message_bytes:
                raise ValueError(f"one block of layers {layer}-{end - 1} is {per_block} bytes, more than "
                                 f"max_message_bytes ({max_message_bytes}); lower layer_group or raise the limit")
            step = max(1, max_message_bytes // per_block)
            for b in range(0, num_blocks, step):
                messages.append(Message(len(messages), piece.src_rank, piece.dst_rank, range(layer, end),
                                        piece.kv_heads, range(b, min(num_blocks, b + step))))
            layer = end
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"the transfer needs {len(messages)} messages, more than {MAX_MESSAGES}; raise layer_group "
                         f"or max_message_bytes")
    return tuple(messages)
