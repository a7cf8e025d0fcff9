"""The GPT (transformer.py: build_model) and the encoding schedule. Above the encodings
and the attention; this file imports nothing (posbench.build_model is the public name)."""
