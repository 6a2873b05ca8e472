"""The event log (the only truth about each sample), its fold, the build lock, and read-only queries (also over the owner's socket during a run)."""
