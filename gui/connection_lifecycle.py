"""What happens to a connection to agents after it is opened: released when nobody will use it,
and a lost agent shown as offline. No widgets here: only the hooks the screens are wired with."""

from __future__ import annotations


def close_connection(result) -> None:
    """``on_discarded`` of ``agents_connection.open_coordinator`` (a second Connect superseded
    the first): close the (coordinator, statuses) nobody will use, so its IO thread and ZeroMQ
    context end."""
    coordinator, _statuses = result
    coordinator.close()
