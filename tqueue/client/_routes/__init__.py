"""Payload routes: how a storage unit's bytes travel between it and this client.

One route per unit, picked once by :class:`~tqueue.client._connections.Connections`:
:class:`InlineRoute` (ZeroMQ frames, every unit), :class:`BulkRoute` (the unit's bulk TCP
streams), :class:`ArenaRoute` (the arena of a unit on this host) and ``NixlRoute``
(one-sided NIXL transfers of a unit's arena, from ``.nixl``: imported only where a client
uses it). A new route is one new
module with a :class:`Route` subclass, and one line where the connections pick it.

Map: docs/architecture.md#payload-routes
"""

from .arena import ArenaRoute
from .base import BatchBuffers, Outgoing, Releases, Route, Sent
from .bulk import BulkRoute
from .inline import InlineRoute

__all__ = ["ArenaRoute", "BatchBuffers", "BulkRoute", "InlineRoute", "Outgoing", "Releases", "Route", "Sent"]
