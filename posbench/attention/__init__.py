"""The attention paths (paths.py) and what they read: spans, temperature, lag
biases. Below the encodings, which import span and temperature; this file imports
nothing, so importing a module here does not pull the encodings in (no cycle)."""
