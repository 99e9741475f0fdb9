"""What one member may say about another (issue 22: the certified insider).

SWIM lets any member spread news about any other. With certified insiders that news cannot be
taken on trust, so membership (``dissemination.Dissemination.merge``) treats it as follows:

- A member's *alive* state and incarnation are its own word: taken only first-hand, from the
  member itself (its heartbeat, its answer to our ping, its handshake or push-pull; mTLS binds the
  caller to the node id it claims). Relayed "X is alive at i" only hints that X is worth a probe.
- A third party's *suspect* or *dead* claim about X is a hint too: this node probes X itself and
  acts (suspects X) only on its own failed probe. A claim the probe refutes is a *strike* against
  its source; a source with ``STRIKE_LIMIT`` strikes in ``STRIKE_WINDOW_S`` has its claims dropped
  unread (each dropped claim counts as one more strike, so a liar stays muted while it lies).
- Incarnations are bounded (``implausible``): never past ``MAX_INCARNATION`` (2^63 − 1: nothing
  on the wire, uint64, or any +1 can overflow), and a jump past ``MAX_STEP`` above what is known
  is refused unless it is a restart (incarnations start from the clock, in ms).

Signed relayed claims (the subject's certificate key over its incarnation) would let alive news
travel second-hand; first-hand-only needs no key handling, and loses little: a node hears every
member it probes first-hand within one round-robin pass."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable

MAX_INCARNATION = 2**63 - 1  # int64's largest: safe in the proto's uint64 and in any +1 check
MAX_STEP = 16  # a member raises its own incarnation by one per refutation
RESTART_SKEW_S = 3600.0  # a restart starts from the clock (ms); clocks may differ by this much
STRIKE_LIMIT = 5  # refuted claims in the window before a source's claims are dropped unread
STRIKE_WINDOW_S = 60.0
MAX_SOURCES = 1024  # sources remembered (all are certified members; the oldest are forgotten)


def implausible(claimed: int, known: int, *, restart: bool = True) -> str | None:
    """Why incarnation ``claimed`` cannot follow ``known`` (None: it can). ``restart``: a jump up
    to the clock (ms, plus skew) is a restart, allowed — but not for this node's own incarnation,
    which it knows exactly."""
    if claimed < 0 or claimed > MAX_INCARNATION:
        return f"incarnation {claimed} is outside 0..2^63-1"
    if claimed <= known + MAX_STEP:
        return None
    if restart and claimed <= (time.time() + RESTART_SKEW_S) * 1000:
        return None
    return f"incarnation {claimed} jumps more than {MAX_STEP} past {known}"


class Strikes:
    """Unconfirmed claims per source: a sliding window decides who is muted; totals for /status."""

    def __init__(
        self,
        limit: int = STRIKE_LIMIT,
        window_s: float = STRIKE_WINDOW_S,
        on_strike: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.limit, self.window_s, self.on_strike, self.clock = limit, window_s, on_strike, clock
        self._recent: OrderedDict[str, deque[float]] = OrderedDict()
        self.totals: dict[str, dict[str, int]] = {}  # source -> {"strikes", "dropped"}
        self.last_reason: dict[str, str] = {}

    def _window(self, source: str) -> deque[float]:
        q = self._recent.get(source)
        if q is None:
            q = self._recent[source] = deque(maxlen=4 * self.limit)
            while len(self._recent) > MAX_SOURCES:
                old, _ = self._recent.popitem(last=False)
                self.totals.pop(old, None)
                self.last_reason.pop(old, None)
        self._recent.move_to_end(source)
        cutoff = self.clock() - self.window_s
        while q and q[0] < cutoff:
            q.popleft()
        return q

    def strike(self, source: str, reason: str, *, dropped: bool = False) -> None:
        if not source:
            return  # this node's own (or a test's) news: nobody to count against
        self._window(source).append(self.clock())
        t = self.totals.setdefault(source, {"strikes": 0, "dropped": 0})
        t["strikes"] += 1
        t["dropped"] += dropped
        self.last_reason[source] = reason
        if self.on_strike is not None:
            self.on_strike()

    def muted(self, source: str) -> bool:
        return bool(source) and source in self._recent and len(self._window(source)) >= self.limit

    def of(self, source: str) -> int:
        return self.totals.get(source, {}).get("strikes", 0)

    def view(self) -> dict[str, dict[str, object]]:
        return {s: {**t, "muted": self.muted(s), "last": self.last_reason.get(s, "")} for s, t in self.totals.items()}
