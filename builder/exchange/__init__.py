"""A build in and out of trainers' files: `export` and `imports` (dumps in)."""
