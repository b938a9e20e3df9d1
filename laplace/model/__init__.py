"""GLA model: math forms (gla.py) and the language model with its decode State (lm.py)."""

from laplace.model.lm import LaplaceLM, State

__all__ = ["LaplaceLM", "State"]
