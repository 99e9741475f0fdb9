"""Data privacy: what a node lets out about its private data (purposes, DP mechanisms, ledger)."""
