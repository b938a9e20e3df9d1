"""Evaluations of an exported model: numerics (compiled vs eager vs fp64 gates), MQAR and passkey
retrieval, and memory accounting (state vs KV cache, decode RSS)."""
