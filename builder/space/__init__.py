"""Storage awareness: disk watermarks (pause before the volume fills), ballast, and capacity projection."""
