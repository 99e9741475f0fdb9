"""Peer identity: a network CA, node certificates that carry the node id, and the TLS credentials
built from them (``pki``, ``credentials``)."""
