"""One eviction policy = one small class making one decision.

The owner (the L1 memory tier, or the replay simulator on a virtual clock) does all accounting: it stores
values, counts bytes, enforces capacity and quotas. The policy only keeps its order structure up to date
through the ``on_*`` notifications and, when asked, names the key to evict next with ``victim()``.
Time comes from the injected ``clock`` and randomness from the injected ``rng``, never from globals, so
that replay is deterministic.
"""

from __future__ import annotations

import abc
import random
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from ..errors import StoreConfigError

Clock = Callable[[], float]


class EntryInfo(NamedTuple):
    """What a policy may know about an entry when it is inserted (a named tuple: one is made per write).

    The fields after ``weight`` describe the access itself; owners that do not know them leave the defaults.
    For KV blocks (Mooncake traces) ``req`` numbers the request, ``pos`` is the block's place in the request's
    prefix chain (0 = first), ``req_len`` the request's length in blocks, ``parent`` the key of the block
    before it in the chain (``None`` for the first block or when unknown), ``req_out`` the request's output
    length in tokens (-1 when unknown): what it generated, known when it completes, so a policy given it must
    not use it for decisions before then (the learned policy classifies the request's blocks at completion);
    ``rule`` names the caching rule.
    """

    size: int
    ns: str = ""
    saved_ms: float = 0.0
    weight: float = 1.0  # the tenant's weight (policy `tenants.<name>.weight`), for score-based policies
    rule: str = ""
    req: int = -1
    pos: int = -1
    req_len: int = 0
    parent: Hashable | None = None
    req_out: int = -1


@dataclass(frozen=True, slots=True)
class BuildContext:
    """What the owner of a policy knows when it builds one by name (``make_eviction_policy``).

    ``policies`` maps the registered names to classes: a policy that composes another (a learned policy's
    fallback, a look-ahead's base) builds it by name through ``build``. ``capacity`` is the owner's capacity in
    the unit of ``EntryInfo.size`` (None: not told); it reaches the classes that size a structure by it.
    ``background`` is True for an owner on a request path: a learned policy then trains on its own thread.
    ``clock`` and ``rng`` are the time and randomness the policy is given.
    """

    policies: Mapping[str, type[EvictionPolicy]]
    capacity: int | None = None
    background: bool = False
    clock: Clock = time.monotonic
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def build(self, name: str, **options: Any) -> EvictionPolicy:
        """A new policy of the registered ``name``, with ``options`` (the class's own keywords).

        Raises ``StoreConfigError`` naming the known policies for an unknown name; an option the class does
        not take raises ``TypeError`` and a bad value ``ValueError``, from the class itself.
        """
        try:
            cls = self.policies[name]
        except KeyError:
            known = ", ".join(sorted(self.policies))
            raise StoreConfigError(f"unknown eviction policy {name!r}; known: {known}") from None
        return cls.build(self, **options)


class EvictionPolicy(abc.ABC):
    """Tracks the keys held by its owner and chooses victims.

    Contract (checked by the shared suite in tests/test_eviction.py):
    - ``on_insert`` is called once per key added, ``on_hit`` (or ``on_hits``, batched) on every hit,
      ``on_remove`` whenever the owner
      drops a key for any reason (evicted, expired, deleted, replaced: a replacement is remove + insert).
    - ``victim()`` returns a key currently held and does not remove it; the owner calls ``on_remove`` after.
      ``victim(ns)`` restricts the choice to keys inserted with that namespace (tenant quotas).
      It raises ``KeyError`` when no key qualifies.
    - Policies are deterministic given the same notifications, clock readings and rng seed.
    """

    name: str = ""
    uses_context: ClassVar[bool] = False
    """True for policies that want every access's context: the owner then calls ``on_access`` before the
    ``on_hit`` or ``admit``/``on_insert`` of each access. Owners may skip building the context otherwise."""

    def __init__(self, *, clock: Clock = time.monotonic, rng: random.Random | None = None) -> None:
        self.clock = clock
        self.rng = rng if rng is not None else random.Random(0)

    @classmethod
    def build(cls, context: BuildContext, **options: Any) -> EvictionPolicy:
        """A new policy for the owner ``context`` describes, with ``options``. This default gives it the
        context's clock and rng; a class that reads the owner's capacity or background flag, or builds the
        policies it composes by name, says so by overriding it."""
        return cls(clock=context.clock, rng=context.rng, **options)

    @abc.abstractmethod
    def on_insert(self, key: Hashable, info: EntryInfo) -> None: ...

    @abc.abstractmethod
    def on_hit(self, key: Hashable) -> None: ...

    def on_hits(self, keys: Sequence[Hashable]) -> None:
        """Hits in the order they happened (the L1 tier replays its read buffer in batches). A policy may
        override it when a batch can be applied more cheaply than hit by hit, with the same result."""
        on_hit = self.on_hit
        for key in keys:
            on_hit(key)

    def on_access(self, key: Hashable, info: EntryInfo) -> None:  # noqa: B027 (optional hook, not abstract)
        """The context of the access about to be notified (hit or miss), for ``uses_context`` policies.
        The default ignores it."""

    def admit(self, key: Hashable, info: EntryInfo) -> bool:
        """Whether a missed ``key`` should be stored at all, asked before the owner makes room for it.

        False bypasses it: the owner serves the miss without storing it (it still counts as a miss) and
        calls nothing else for it. The default admits everything (cache-on-miss).
        """
        return True

    @abc.abstractmethod
    def on_remove(self, key: Hashable) -> None: ...

    @abc.abstractmethod
    def victim(self, ns: str | None = None) -> Hashable: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    def close(self) -> None:  # noqa: B027 (optional hook, not abstract)
        """Release what the policy holds beyond its structure (a learned policy's trainer thread). The owner
        calls it when it stops using the policy (the tier closes, or a new policy replaces this one)."""
