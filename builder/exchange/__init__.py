"""A build in and out of trainers' files: `export` (with `build_info` and `lossy`) and `imports` (dumps in)."""
