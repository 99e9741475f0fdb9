"""Threading policy: what work leaves the event loop for a worker thread.

The event loop carries heartbeats and peer requests, so heavy tensor work must not hold it; light
work must not pay a thread hop either. Strategies, the peer plane and the transport all follow
this one rule."""

from __future__ import annotations

# Tensor work (encode, hash, validate, average) on more bytes than this goes to a worker thread.
# Below it, the hop costs more than the work: a thread handing the GIL back and forth with a
# training thread can wait up to the interpreter's switch interval (5 ms) at each handoff.
OFF_LOOP_BYTES = 1 << 20
