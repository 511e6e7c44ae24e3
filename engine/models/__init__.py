"""Hybrid-attention models: config (config.py), presets (presets.py), layers (layers/),
the decoder (decoder.py) and weights/fingerprints (weights.py)."""
