"""KV transfer: moving a request's paged KV from a prefill replica to a decode replica of any layout.

- plan.py: which source rank sends which layers x KV heads to which destination rank, cut into messages.
- wire.py: tags, the data header, status messages (ACK, ABORT), the keyed MAC every message carries.
- transport.py: the contract; ucx_transport.py (ucxx) and fake_transport.py (in-process) implement it.
- staging.py: the reusable buffer messages in flight live in; shm.py: that buffer in shared memory, and the
  mappings a receiver keeps of senders' buffers, for payloads sent by reference between agents of one host.
- device_copy.py: every copy between a rank's KV store (CPU or CUDA) and message slots (KVCopier).
- agent.py: one per rank, beside its KV store: sends as layers are computed, receives, verifies, writes;
  rank_transfer.py: what it tracks of each transfer; inbox.py: takes messages off the wire without trusting
  them; replies.py: the ACKs and ABORTs it sends, to addresses it was given only; drops.py: what it dropped.
- agent_factory.py: builds a rank's agent inside the rank's process (LLMEngine(kv_agent=...)).
- replica_agents.py: the typed facade the driver calls every rank's agent through (expect, arm, poll, abort, release).
- connector.py: the per-request state machines of a replica (decode: reserve/admit; prefill: submit) and
  the disaggregated lifecycle, step by step.
"""
