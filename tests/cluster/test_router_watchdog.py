"""The controller's router watchdog (cluster/controller.py Controller._watch_router) on a stand-in router: a slow
heartbeat answer is not a dead router (a busy 2-core machine once missed one, and the live router was killed with
its requests), ROUTER_MISSED_HEARTBEATS in a row are, and a dead router is replaced at the first heartbeat. The
heartbeat's period and timeout are shortened; no Ray cluster runs (tests/cluster/test_failover.py kills a real
router)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import ray

from tandem.cluster import controller as controller_module
from tandem.cluster.controller import ROUTER_MISSED_HEARTBEATS, Controller

PERIOD_S, TIMEOUT_S = 0.01, 0.05


class StandIn:
    """A router whose stats() answer takes delays[i] seconds on the i-th heartbeat (None: it is dead)."""

    def __init__(self, delays: list[float | None]):
        self.delays = list(delays)
        self.stats = SimpleNamespace(remote=self._stats)

    async def _stats(self):
        delay = self.delays.pop(0) if self.delays else 0.0
        if delay is None:
            raise ray.exceptions.RayActorError()
        await asyncio.sleep(delay)


def watch(delays: list[float | None]) -> list[str]:
    """Runs the watchdog until a stand-in router has answered every delay, and a few heartbeats more; returns the
    replacements' reasons."""
    replaced: list[str] = []

    async def replace(why: str) -> None:
        replaced.append(why)

    owner = SimpleNamespace(router=StandIn(delays), _replace_router=replace)

    async def scenario():
        task = asyncio.create_task(Controller._watch_router(owner))
        while owner.router.delays:
            await asyncio.sleep(PERIOD_S)
        await asyncio.sleep(4 * (PERIOD_S + TIMEOUT_S))
        task.cancel()

    asyncio.run(scenario())
    return replaced


@pytest.fixture(autouse=True)
def short_heartbeats(monkeypatch):
    monkeypatch.setattr(controller_module, "HEARTBEAT_S", PERIOD_S)
    monkeypatch.setattr(controller_module, "HEARTBEAT_TIMEOUT_S", TIMEOUT_S)


def test_slow_heartbeats_short_of_the_limit_replace_nothing():
    slow = 2 * TIMEOUT_S
    # Misses up to one fewer than the limit, answered between: never that many in a row.
    delays = ([slow] * (ROUTER_MISSED_HEARTBEATS - 1) + [0.0]) * 3
    assert watch(delays) == []


def test_the_limit_of_missed_heartbeats_in_a_row_replaces_the_router():
    slow = 2 * TIMEOUT_S
    replaced = watch([slow] * ROUTER_MISSED_HEARTBEATS)
    assert replaced == [f"it left {ROUTER_MISSED_HEARTBEATS} heartbeats in a row unanswered within {TIMEOUT_S:g} s "
                        f"each"]


def test_a_dead_router_is_replaced_at_its_first_heartbeat():
    replaced = watch([None])
    assert len(replaced) == 1 and replaced[0].startswith("it died")
