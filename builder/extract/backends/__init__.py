"""Where forward passes happen. A backend takes requests (a sample's token ids) and hands back states; the
worker's loop is the same for every backend (see base.Backend). Which backends exist and how they are found:
registry.py; what an engine with an inference server provides besides: serving.py (docs/design.md section 12)."""
