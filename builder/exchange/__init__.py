"""A build in and out of trainers' files: `export` (with `lossy`) and `imports` (dumps in)."""
