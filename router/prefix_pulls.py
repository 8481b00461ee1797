"""Prefix pulls: before a prefill replica computes a prompt, it may pull the prompt's leading blocks from another
replica that holds them on its device, over the existing KV transfer (kv_transfer/connector.py: same wire
format, MACs and re-sharding between layouts), instead of computing them again.

The holder may be another prefill replica (the prefix was routed there before, and the chosen replica was picked
for its load) or a decode replica: a session's earlier turn was decoded there, so its blocks hold the turn's
answer too, which no prefill replica ever computed. Blocks the holder keeps only on its host or disk KV tier are
copied up to its device first (it runs the prefix as a one-token request: its tiers serve the blocks, at most the
last block is computed), at their tier hit costs plus that block.

The decision (plan(), plain Python over the router's own state): for the chosen prefill replica P, whose weighed
cached prefix (Routing: device blocks whole, tier blocks by their hit cost) is `own` blocks, and each other replica
H whose events say it holds `depth` leading blocks (on its device or tiers), a pull of those saves depth - own
blocks of prefill and costs pull_cost blocks of prefill for each block sent (those P does not hold on its device
already: P keeps its own and receives the rest), where pull_cost is what pulling a block costs against computing it:
measured from the pulls made so far (seconds per block over P's measured prefill seconds per block, averaged),
PRIOR_PULL_COST before any. The pull with the largest saving is made when it saves at least
RoutingSettings.pull_min_blocks blocks (0: never pull).

The pull (run()): P reserves blocks for the prefix's tokens (reserve_prefix, naming H's agents; its own cached
blocks of the prefix are reused and the descriptor covers the rest), H sends its cached blocks of those hashes at
once (send_prefix, returns once P's ranks have acknowledged them), P puts them in its prefix cache (keep_prefix);
the prefill that follows finds them there. Any failure (H evicted them meanwhile, a transfer that failed, a replica
that died, no room on P) abandons the pull: P's reservation is aborted (H learns it from its agents) and the prompt
is computed as if no pull had been planned. Counted by outcome for /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

from tandem.router.kv_index import PrefixIndex
from tandem.router.replicas import Replica, ReplicaPools
from tandem.router.request_parsing import ParsedRequest
from tandem.router.routing import RoutePlan

_log = logging.getLogger(__name__)

PRIOR_PULL_COST = 0.2  # a block over the network against computing it, until pulls were measured
_SMOOTHING = 0.3  # weight of the newest measurement in the running pull cost


@dataclass(frozen=True)
class PullPlan:
    """Pull the first `blocks` blocks of the prompt (hashes[:blocks]) from holder into the prefill replica;
    saved: the prefill blocks it is expected to save, net of its cost. bring_up: some of them are only on the
    holder's KV tiers (it copies them up to its device first)."""

    holder: Replica
    blocks: int
    saved: float
    bring_up: bool = False


class PrefixPulls:
    def __init__(self, block_size: int, min_blocks: int, indexes: Mapping[str, PrefixIndex], pools: ReplicaPools):
        """indexes: the routing's prefix index of each pool; pools: the replicas routed to."""
        self.block_size = block_size
        self.min_blocks = min_blocks
        self.indexes = indexes
        self.pools = pools
        self.pull_cost = PRIOR_PULL_COST
        self.measured = False
        self.outcomes: Counter[str] = Counter()  # "pulled" / "no_room" / "failed" -> pulls
        self.blocks_pulled = 0

    def plan(self, hashes: Sequence[int], prefill: Replica, own: float) -> PullPlan | None:
        """The best pull for a prompt of block hashes `hashes` about to be computed on `prefill`, whose own cached
        prefix is worth `own` blocks. None: no pull pays."""
        if not self.min_blocks or len(hashes) - own < self.min_blocks:
            return None  # (no pull can save more than the blocks it lacks: nothing more to look at)
        best: PullPlan | None = None
        has = self.indexes[prefill.pool].confirmed_depth(prefill.name, hashes)  # its own blocks are not sent
        for holder in self.pools.all():
            if holder is prefill or (holder.info is not None and not holder.info.kv_addresses):
                continue  # (a replica without KV agents sends nothing)
            index = self.indexes[holder.pool]
            depth = index.confirmed_depth(holder.name, hashes, tiers=True)
            if not depth:
                continue
            host, disk = index.lower_tier_blocks(holder.name, hashes[:depth])
            costs = holder.load.tier_hit_costs  # bringing those up on the holder, its last block computed
            up = host * costs.host + disk * costs.disk + 1 if host or disk else 0.0
            saved = depth - own - (depth - min(has, depth - 1)) * self.pull_cost - up
            if saved >= self.min_blocks and (best is None or saved > best.saved):
                best = PullPlan(holder, depth, saved, bool(host or disk))
        return best

    async def before_prefill(self, route: RoutePlan, prefill: Replica, pull_id: str, request: ParsedRequest) -> int:
        """Pulls the prompt's prefix into prefill where plan() says it pays (under pull_id there); returns the
        blocks pulled (0: none). A request of a LoRA adapter pulls nothing (its blocks are salted by the adapter,
        and a pull's holder and puller hash the base model's)."""
        pull = None if request.params.lora is not None else self.plan(route.hashes, prefill, route.cached_blocks)
        if pull is None:
            return 0
        return await self.run(pull, pull_id, request.prompt_token_ids, route.hashes, prefill, request.cache_salt)

    async def run(self, pull: PullPlan, pull_id: str, prompt: Sequence[int], hashes: Sequence[int],
                  prefill: Replica, cache_salt: str | None) -> int:
        """Makes the pull (see the module docstring); returns the blocks now cached on prefill (0: abandoned).
        Cancelled (the request went away), it aborts the reservation on prefill and re-raises."""
        start = time.monotonic()
        reserved = False
        try:
            descriptor = await prefill.api.reserve_prefix(pull_id, tuple(prompt[:pull.blocks * self.block_size]),
                                                          cache_salt=cache_salt,
                                                          senders=_addresses(pull.holder))
            if descriptor is None:
                self.outcomes["no_room"] += 1
                return 0
            reserved = True
            first = pull.blocks - descriptor.num_tokens // self.block_size  # (the puller caches those before)
            await pull.holder.api.send_prefix(
                pull_id, tuple(hashes[first:pull.blocks]), descriptor, cache_salt=cache_salt,
                prefix_token_ids=tuple(prompt[:pull.blocks * self.block_size]) if pull.bring_up else ())
            kept = await prefill.api.keep_prefix(pull_id)
        except Exception as e:  # any failure: compute the prompt instead
            self.outcomes["failed"] += 1
            _log.info("prefix pull %s from %s to %s abandoned: %r", pull_id, pull.holder.name, prefill.name, e)
            if reserved:
                await asyncio.shield(_abort(prefill, pull_id))
            return 0
        except BaseException:
            if reserved:
                await asyncio.shield(_abort(prefill, pull_id))
            raise
        self.outcomes["pulled"] += 1
        self.blocks_pulled += kept
        self._observe(time.monotonic() - start, kept, prefill.load.prefill_tokens_per_s)
        return kept

    def _observe(self, seconds: float, blocks: int, prefill_tokens_per_s: float | None) -> None:
        """Folds one pull's measured cost into pull_cost (needs the puller's measured prefill speed)."""
        if not blocks or not prefill_tokens_per_s:
            return
        cost = (seconds / blocks) / (self.block_size / prefill_tokens_per_s)
        self.pull_cost = cost if not self.measured else (1 - _SMOOTHING) * self.pull_cost + _SMOOTHING * cost
        self.measured = True


def _addresses(replica: Replica) -> tuple[str, ...]:
    return replica.info.kv_addresses if replica.info is not None else ()


async def _abort(replica: Replica, pull_id: str) -> None:
    try:
        await replica.api.abort(pull_id)
    except Exception as e:  # a dead replica frees nothing and needs nothing
        _log.debug("abort of prefix pull %s on %s failed: %r", pull_id, replica.name, e)
