"""Where hidden states come from: sources (samples to extract), models, and the demo sample set."""
