"""The data: Zarr v3 segments written once, ragged along the token axis; codecs, checksums, reading back."""
