"""What agents' sockets sent during a piece of work, from their own counters.

Each agent counts the bytes it hands to ZeroMQ, per link and per kind (``agents.transport.WireCounts``,
reported cumulatively in ``AgentStatus.wire_sent``); a run's traffic is the difference of a snapshot
taken before it and one after. Figures built on this are measured on the wire (headers, framing and
every frame a technique sends included), not re-derived from the tensors with the prediction's formula.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from agents.protocol import AgentStatus


class WireTraffic(msgspec.Struct, frozen=True):
    """Messages and bytes sent, keyed by (sender device, link, kind)."""

    sent: dict[tuple[str, str, str], tuple[int, int]] = {}

    def nbytes(self, *, kinds: Iterable[str] | None = None, senders: Iterable[str] | None = None,
               links: Iterable[str] | None = None) -> int:
        """Bytes sent, optionally only of these kinds / by these senders / on links to these peers."""
        kinds, senders, links = (None if x is None else set(x) for x in (kinds, senders, links))
        return sum(n for (sender, link, kind), (_, n) in self.sent.items()
                   if (kinds is None or kind in kinds) and (senders is None or sender in senders)
                   and (links is None or link in links))

    def per_link_and_kind(self) -> dict[str, int]:
        """``sender->link kind`` → bytes, for a JSON report."""
        return {f"{s}->{link} {kind}": n for (s, link, kind), (_, n) in sorted(self.sent.items())}


def snapshot(statuses: Mapping[str, AgentStatus]) -> WireTraffic:
    """The agents' cumulative counters as one ``WireTraffic``."""
    return WireTraffic({(device, c.link, c.kind): (c.messages, c.nbytes)
                        for device, status in statuses.items() for c in status.wire_sent})


def sent_between(before: WireTraffic, after: WireTraffic) -> WireTraffic:
    """What was sent after ``before`` and up to ``after`` (an agent restarted in between counts from 0)."""
    out = {}
    for key, (m, n) in after.sent.items():
        m0, n0 = before.sent.get(key, (0, 0))
        if m < m0:  # counter restarted with its agent
            m0 = n0 = 0
        if m - m0:
            out[key] = (m - m0, n - n0)
    return WireTraffic(out)
