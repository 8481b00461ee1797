"""How the replicas know a request (DESIGN.md section 2, ingress). Plain Python.

A client names its request (ParsedRequest.request_id); that id is the one the router keeps and reports, from the
front door to the client's last chunk. Replicas need a name unique across tenants and runs, and one per attempt
after a move, so the router calls them with RunKey.replica_id() and nothing else builds such an id:

  f"{tenant}/{request_id}/{run}"            the first attempt (no "tenant/" with authentication off)
  f"{tenant}/{request_id}/{run}.p{k}"       a prefill retry, the request's k-th move (migration.py)
  f"{tenant}/{request_id}/{run}.m{k}"       a migration, the request's k-th move (migration.py)
  f"{...}.local"                            the decode replica prefilling after a failed transfer

A client id never holds '/', so two tenants' ids never meet; the run number (Serving counts requests run) keeps
a reused id apart from its earlier run, which replicas remember for a while once aborted; an attempt after a
move has its own id because the one before it may still be winding down on its replica.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MOVE_KINDS = ("p", "m")  # a prefill retry, a migration


@dataclass(frozen=True)
class RunKey:
    """One attempt of one run of a request. tenant: who sent it (None: authentication is off); request_id: the
    client's id, unchanged; run: Serving's number for this run (None: the caller made request_id unique itself,
    as tests, benches and the mock cluster do); move: "" for the first attempt, else f"{kind}{k}" (see
    moved()); local: the decode replica prefills the prompt itself after this attempt's transfer failed."""

    tenant: str | None
    request_id: str
    run: int | None = None
    move: str = ""
    local: bool = False

    def replica_id(self) -> str:
        """The id the replicas know this attempt by (the module docstring lists the forms). Every call on a
        replica, and every abort, uses it."""
        scope = "" if self.tenant is None else f"{self.tenant}/"
        run = "" if self.run is None else f"/{self.run}"
        move = f".{self.move}" if self.move else ""
        return f"{scope}{self.request_id}{run}{move}{'.local' if self.local else ''}"

    def moved(self, kind: str, number: int) -> RunKey:
        """The key of the request's number-th move (counted by migration.Replay), of kind "p" (a prefill retry)
        or "m" (a migration). It replaces an earlier move's suffix: moves are numbered per request, not nested.
        Raises ValueError for another kind or a number below 1."""
        if kind not in MOVE_KINDS or number < 1:
            raise ValueError(f"a move is one of {MOVE_KINDS} numbered from 1, got {kind!r} {number}")
        return replace(self, move=f"{kind}{number}", local=False)

    def prefilled_locally(self) -> RunKey:
        """The key under which the decode replica prefills this attempt's prompt after its transfer failed (the
        failed reservation, under this key's id, may still be winding down on the same replica)."""
        return replace(self, local=True)
