"""The transport layer: moves frames between processes and owns every failure of doing so.

``_zmq`` holds the request/reply peers and the server loop over ZeroMQ; ``_bulk`` the plain TCP
streams that carry big puts and gets beside it; ``_arena`` both halves of the same-host
shared-memory path (the unit's arena and a client's mapping of it). ZeroMQ, socket, OS and
decode failures become :mod:`tqueue.errors` here and nowhere else. The transport imports the
wire layer and never a role.
"""
