"""Coterie's tests, a package so that the helpers beside them (nodeproc, strategy_harness, peer_fuzz,
fake_node, fake_daemon, transports) import as ``tests.<helper>`` with no ``sys.path`` edits."""
