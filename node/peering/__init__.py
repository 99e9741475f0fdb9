"""The peer plane in domain terms: membership, served requests, and the network a strategy sees.
Transports (``node/transport``: gRPC) carry its messages; see ``interfaces`` for the two seams."""
