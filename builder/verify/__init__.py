"""Checking what is stored against the log's checksums (sweeps), and removing orphaned bytes (gc)."""
