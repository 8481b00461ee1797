"""`tandem bench --tenant ...`: several tenants loading the server at once, each with its own API key, its share of
the rate and its own request lengths, as a platform shared by teams sees them (issue 50's fair scheduling and
rate limits are measured this way).

    --tenant chat,share=1,key_env=CHAT_KEY,input=lognormal:96,0.3,output=fixed:32
    --tenant batch,share=5,key=sk-batch-...,input=uniform:600,1000,output=fixed:64

A tenant's fields after its name: share (its rate is --rate x share; default 1), key or key_env (its API key,
or the environment variable holding it; default --api-key's), input and output (default --input/--output).
Each tenant runs an open loop of its own at its rate, with its own arrivals and prompts, over a backend of its
own; their requests' records carry the tenant's name as their class, so the summary's by_class gives each
tenant's latencies."""

from __future__ import annotations

import asyncio
import os
import re
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

from tandem.bench.loadgen.records import RequestRecord
from tandem.bench.loadgen.workloads import LengthDist, parse_length

_FIELDS = ("share", "key", "key_env", "input", "output")


@dataclass(frozen=True)
class TenantLoad:
    name: str
    share: float = 1.0
    key: str | None = None  # None: the run's --api-key
    input: LengthDist | None = None  # None: the run's --input
    output: LengthDist | None = None


def parse_tenant(text: str) -> TenantLoad:
    """NAME[,field=value...] as the module docstring says. Raises ValueError naming what is wrong."""
    name, *pairs = re.split(r",(?=[a-z_]+=)", text.strip())
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"--tenant {text!r}: start with the tenant's name (letters, digits, _ . -)")
    values: dict[str, str] = {}
    for pair in pairs:
        field, _, value = pair.partition("=")
        if field not in _FIELDS:
            raise ValueError(f"--tenant {name}: unknown field {field!r} (known: {', '.join(_FIELDS)})")
        values[field] = value
    if "key" in values and "key_env" in values:
        raise ValueError(f"--tenant {name}: give key or key_env, not both")
    key = values.get("key")
    if "key_env" in values:
        key = os.environ.get(values["key_env"])
        if not key:
            raise ValueError(f"--tenant {name}: the environment variable {values['key_env']} is not set")
    try:
        share = float(values.get("share", 1.0))
    except ValueError:
        raise ValueError(f"--tenant {name}: share must be a number, got {values['share']!r}") from None
    if not share > 0:
        raise ValueError(f"--tenant {name}: share must be positive, got {share:g}")
    return TenantLoad(name, share, key, parse_length(values["input"]) if "input" in values else None,
                      parse_length(values["output"]) if "output" in values else None)


async def run_tenants(tenants: Sequence[TenantLoad],
                      load: Callable[[TenantLoad, int], Awaitable[list[RequestRecord]]]) -> list[RequestRecord]:
    """Runs load(tenant, its place) for every tenant at once and returns all their records, each record's class
    the tenant's name (its workload class after a slash when it has one), numbered anew in the order they were
    due."""
    runs = await asyncio.gather(*(load(tenant, i) for i, tenant in enumerate(tenants)))
    records = []
    for tenant, mine in zip(tenants, runs):
        for record in mine:
            record.klass = tenant.name if record.klass == "request" else f"{tenant.name}/{record.klass}"
        records += mine
    records.sort(key=lambda r: r.scheduled_s)
    for index, record in enumerate(records):
        record.index = index
    return records
