"""Creating a build and running it: the plan replayed from the log, the coordinator that owns the log, the workers."""
