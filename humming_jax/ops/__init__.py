"""Thin wrappers, one module per family, over the ``humming_jax.*`` custom calls.

Each function states its operands' shapes and attributes and issues exactly one custom call;
validation that needs Python values happens in the callers (experts and fused_moe).
"""
