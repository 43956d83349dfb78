"""Where a port call's time went outside the model's own compute: the hops of a round's overhead.

A round's overhead is its wall time minus the draft's and the target's
compute (RoundRecord.overhead_ms). A port that crosses a transport says
where the rest of each call went, hop by hop, so the overhead can be named
and cut: a call's round trip at the caller is

    compute + batch + queue + reply + wire + wake

and what is left of the round after its calls is the caller's own work
(the loop, message building and parsing, the observer). In-process ports
have no hops (None).
"""

from __future__ import annotations

from dataclasses import dataclass

# Hop names, in the order a call meets them (the `hop` label of the metrics).
HOPS = ("queue", "batch", "reply", "wire", "wake")


@dataclass(frozen=True)
class Transit:
    """One port call's time outside the model step, in ms (each >= 0)."""

    queue_ms: float = 0.0  # service: read from the stream -> its batch started on the model thread
    batch_ms: float = 0.0  # service: its batch's time on the model thread beyond this step's compute
    reply_ms: float = 0.0  # service: the batch ended -> the response handed to the transport
    wire_ms: float = 0.0  # both ways between the processes: serialisation, transport, network or loopback
    wake_ms: float = 0.0  # caller: the response read -> the waiting round resumed

    @property
    def total_ms(self) -> float:
        return self.queue_ms + self.batch_ms + self.reply_ms + self.wire_ms + self.wake_ms

    def hops(self) -> tuple[tuple[str, float], ...]:
        """(hop name, ms) in HOPS order."""
        return tuple(zip(HOPS, (self.queue_ms, self.batch_ms, self.reply_ms, self.wire_ms, self.wake_ms)))

    @staticmethod
    def of_round_trip(
        round_trip_ms: float, compute_ms: float, queue_ms: float, batch_ms: float, reply_ms: float, wake_ms: float
    ) -> Transit:
        """Split a call's round trip (send -> response read, caller's clock) by what the service measured.

        batch_ms here is the whole batch (the service's figure); the step's own compute is taken out.
        """
        extra = max(0.0, batch_ms - compute_ms)
        inside = queue_ms + batch_ms + reply_ms
        return Transit(queue_ms, extra, reply_ms, max(0.0, round_trip_ms - inside), max(0.0, wake_ms))
