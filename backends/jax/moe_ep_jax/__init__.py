"""MoeEp for JAX: backend ``jax`` (``moe_ep_spec.get_backend("jax")``).

Importing this package does not import jax. The pieces:

- :mod:`moe_ep_jax.api`: what JAX users call inside ``jax.shard_map``: the fused
  layer :func:`~moe_ep_jax.api.moe_ep`, the layered
  :func:`~moe_ep_jax.api.ep_dispatch` / :func:`~moe_ep_jax.api.ep_combine` (all
  ``jax.custom_vjp``, jit-compatible, static shapes), and the spec's explicit
  backward passes.
- :mod:`moe_ep_jax.core`: the layer written once: routing plan, exchange
  (``ragged_all_to_all`` or fixed per-peer capacity ``all_to_all``), static
  expert-major layout.
- :mod:`moe_ep_jax.kernels`: the local expert computation behind a small
  protocol (:class:`~moe_ep_jax.kernels.ExpertKernels`); the default provider is
  XLA-native (``jax.lax.ragged_dot``).
- :mod:`moe_ep_jax.formats`: bf16, mxfp8 and nvfp4 in ``jax.numpy``, bit-exact.
- :mod:`moe_ep_jax.backend`: the world-launch backend the conformance suite runs.

See ``docs/jax.md``.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
