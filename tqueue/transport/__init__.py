"""The transport layer: moves frames between processes and owns every failure of doing so.

``_zmq`` holds the request/reply peers and the server loop over ZeroMQ; ``_bulk`` the plain TCP
streams that carry big puts and gets beside it; ``_arena`` both halves of the same-host
shared-memory path (the unit's arena and a client's mapping of it). ZeroMQ, socket, OS and
decode failures become :mod:`tqueue.errors` here and nowhere else, through the boundaries of
``_boundary``. The transport imports the wire layer's messages and never its codec of payload
(``_pack``: packed frames reach the bulk streams through their own protocols) nor a role.

Map: docs/architecture.md#the-transport
"""
