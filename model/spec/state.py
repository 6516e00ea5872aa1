"""Per-rank and whole-system state.

States are plain mutable dataclasses with an explicit ``copy()``: ``machine.step`` is a
pure function (copy, then apply), while drivers that own their state (the simulator)
call ``machine.apply`` in place and skip the copy. ``key()`` gives a hashable snapshot
for explicit-state exploration.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from model.spec.kvpoll import KVPoll
from model.spec.variants import Variant

ROOM_BIT, PAYLOAD_BIT = 1, 2
ALL_FIELDS = ROOM_BIT | PAYLOAD_BIT


@dataclass(frozen=True)
class Request:
    room: int
    payload: int


@dataclass
class RankState:
    """One TP rank: its transfer queue, receivers, slots and metadata rows."""
    queue: list[int]                  # request ids, in queue order
    recv: dict[int, int]              # queued request -> receiver poll (monotonic, latched)
    age: dict[int, int]               # queued request -> steps kept after a MIN of Transferring
    #                                   or Success (every rank's receiver latched Success)
    slot_of: dict[int, int]           # request -> its slot here, kept while writes may land
    landed: dict[int, int]            # request -> bitmask of its fields visible here
    fenced: set[int]                  # requests whose in-flight writes here are fenced
    quarantined: set[int]             # left the queue; slot waits for its writes (strict)
    room_at: list[int]                # metadata row per slot: bootstrap_room column 0
    payload_at: list[int]             # metadata row per slot: first output token
    free: list[int]                   # FIFO free list: alloc pops the front, free appends
    outcomes: dict[int, tuple[str, int]] = field(default_factory=dict)
    # request -> ("commit", payload read) or ("abort", Decision value)
    held: dict[int, int] = field(default_factory=dict)
    # request aborted as Failed whose slot the variant defers (#35049) -> steps held so far

    def copy(self) -> "RankState":
        return RankState(list(self.queue), dict(self.recv), dict(self.age), dict(self.slot_of),
                         dict(self.landed), set(self.fenced), set(self.quarantined),
                         list(self.room_at), list(self.payload_at), list(self.free),
                         dict(self.outcomes), dict(self.held))

    def key(self) -> tuple:
        return (tuple(self.queue), tuple(sorted(self.recv.items())), tuple(sorted(self.age.items())),
                tuple(sorted(self.slot_of.items())), tuple(sorted(self.landed.items())),
                tuple(sorted(self.fenced)), tuple(sorted(self.quarantined)), tuple(self.room_at),
                tuple(self.payload_at), tuple(self.free), tuple(sorted(self.outcomes.items())),
                tuple(sorted(self.held.items())))

    def room_seen(self, req: int) -> int:
        return self.room_at[self.slot_of[req]]


@dataclass
class SystemState:
    variant: Variant
    n_slots: int
    ranks: list[RankState]
    requests: dict[int, Request]
    steps: int = 0
    hung: tuple[int, ...] | None = None   # queue lengths when the MIN mismatched

    @property
    def n_ranks(self) -> int:
        return len(self.ranks)

    def copy(self) -> "SystemState":
        return SystemState(self.variant, self.n_slots, [r.copy() for r in self.ranks],
                           dict(self.requests), self.steps, self.hung)

    def key(self) -> tuple:
        return (tuple(r.key() for r in self.ranks), tuple(sorted(self.requests.items())),
                self.hung)


def initial_state(variant: Variant, n_ranks: int, n_slots: int) -> SystemState:
    """Empty queues, zeroed rows, every slot free in index order on every rank."""
    if n_ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {n_ranks}")
    if n_slots < 1:
        raise ValueError(f"slots must be >= 1, got {n_slots}")
    ranks = [RankState([], {}, {}, {}, {}, set(), set(), [0] * n_slots, [0] * n_slots,
                       list(range(n_slots))) for _ in range(n_ranks)]
    return SystemState(variant, n_slots, ranks, {})


WAITING = int(KVPoll.WaitingForInput)
