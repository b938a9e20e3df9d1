"""The GLA model: its configuration and presets (config.py), the math in three forms (gla.py),
the language model with its decode State (lm.py), and the exported model format (export.py)."""
