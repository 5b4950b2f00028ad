"""MoeEp for JAX users: jit-compatible, differentiable, inside ``jax.shard_map``.

Every function here is one rank's view: call it inside ``jax.shard_map`` over a
mesh axis (default name ``"ep"``) whose size is ``config.num_ranks``, with each
rank's shard of the arrays. Shapes are static: ``T`` (a shard's token rows) is
the same on every rank; a rank with fewer real tokens pads with rows whose
``topk_idx`` is -1 (they route nowhere, cost nothing in the exchange, and get
an exact zero output and zero gradients). The receive buffer has ``C`` rows:
``config.recv_capacity`` (static layout), or ``num_ranks * T * num_topk``
(dynamic layout: the valid rows come first, ``expert_offsets[-1]`` of them).

Example (4 devices; see docs/jax.md for the whole story)::

    from functools import partial
    import jax, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from moe_ep_spec import MoeEpConfig
    from moe_ep_jax.api import moe_ep

    config = MoeEpConfig(num_experts=8, hidden=64, intermediate=32, num_topk=2,
                         num_ranks=4, max_tokens_per_rank=16)
    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    def layer(x, w1, w2, idx, tw):        # per rank: [16, 64], [2, 64, 64], [2, 32, 64], [16, 2], [16, 2]
        return moe_ep(x, w1, w2, idx, tw, config=config)   # [16, 64] bfloat16

Differentiation: ``jax.grad`` / ``jax.vjp`` through :func:`moe_ep`,
:func:`ep_dispatch` and :func:`ep_combine` follow the spec's backward
(``jax.custom_vjp``; every rounding point straight-through). Cotangents have
the primal's dtype (JAX's rule), so a bfloat16 output receives a bfloat16
cotangent and bfloat16 inputs get bfloat16 gradients; pass float32 inputs for
float32 gradients. Block-scaled inputs are constants to ``jax.grad`` (their
codes are not differentiable); :func:`moe_ep_backward` gives the spec's
gradient with respect to their decoded values.

Errors: shapes, dtypes, formats, the mesh axis and ``max_tokens_per_rank`` are
checked while tracing and raise the spec's error classes
(:mod:`moe_ep_spec.errors`). Data-dependent errors cannot raise inside ``jit``:
an expert id outside ``[-1, num_experts)`` or a receive buffer overflow on any
rank turns every rank's outputs and gradients to NaN (the handle's ``error``
says so); :func:`check_routing` raises the spec's error on the host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Optional, Sequence, Tuple, Union

from .devices import prepare_environment as _prepare_environment

_prepare_environment()  # XLA_FLAGS must ask for enough CPU devices before jax's first import

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from moe_ep_spec.validation import check_num_tokens, check_shape
from moe_ep_spec.config import MoeEpConfig
from moe_ep_spec.errors import CapabilityError, CapacityError, ConfigError, DTypeError, FormatError, RoutingIndexError
from moe_ep_spec.formats import MoeFormat

from . import core
from . import formats as F
from .kernels import DEFAULT_KERNELS

__all__ = ["moe_ep", "moe_ep_backward", "ep_dispatch", "ep_combine", "dispatch_backward", "combine_backward",
           "EpHandle", "shard_moe_ep", "check_routing", "default_exchange", "BlockScaled"]

BlockScaled = F.BlockScaled
Tensor = Union[jax.Array, F.BlockScaled]
_BACKEND = "backend 'jax'"


# ----------------------------------------------------------------------------- static checks


def default_exchange() -> str:
    """``ragged`` (``jax.lax.ragged_all_to_all``) where the default JAX backend
    implements it (GPU, TPU), else ``capacity``. ``MOE_EP_JAX_EXCHANGE`` overrides."""
    forced = os.environ.get("MOE_EP_JAX_EXCHANGE", "").strip().lower()
    if forced:
        if forced not in core.EXCHANGES:
            raise ConfigError(
                f"MOE_EP_JAX_EXCHANGE must be one of {', '.join(core.EXCHANGES)}; got {forced!r}",
                field="exchange",
                value=forced,
            )
        return forced
    return "ragged" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "capacity"


def _check_axis(config: MoeEpConfig, axis_name: Any) -> None:
    try:
        size = lax.axis_size(axis_name)
    except (NameError, KeyError, ValueError, TypeError):
        raise ConfigError(
            f"axis_name must name the EP axis of the enclosing jax.shard_map mesh; got {axis_name!r}, which is not "
            f"a mesh axis here. Call the MoeEp functions inside jax.shard_map over a mesh that has an axis named "
            f"{axis_name!r} of size num_ranks = {config.num_ranks} (or pass axis_name=)",
            field="axis_name",
            value=axis_name,
        ) from None
    if size != config.num_ranks:
        raise ConfigError(
            f"the size of mesh axis {axis_name!r} must equal num_ranks = {config.num_ranks}; got {size}",
            field="num_ranks",
            value=size,
        )


def _dtype_name(x: Any) -> str:
    d = getattr(x, "dtype", None)
    return getattr(d, "name", type(x).__name__) if d is not None else type(x).__name__


def _check_plain(name: str, x: Any) -> None:
    if not hasattr(x, "dtype") or jnp.dtype(x.dtype) not in F.PLAIN_DTYPES:
        raise DTypeError(
            f"{name} must have dtype in (float32, float16, bfloat16) or be a BlockScaled; got {_dtype_name(x)}",
            name=name,
            expected="float32, float16, bfloat16",
            got=_dtype_name(x),
        )


def _check_shape(name: str, got: Tuple[int, ...], want: Tuple[Optional[int], ...], what: str) -> None:
    """One rank's shard must have ``want``: the spec's rule and message
    (``moe_ep_spec.validation.check_shape``)."""
    check_shape(name, tuple(got), want, what)


def _check_tensor(name: str, t: Any, want: Tuple[Optional[int], ...], what: str, blocked_axis: int) -> Tuple[int, ...]:
    if isinstance(t, F.BlockScaled):
        t.validate(name)
        if t.axis != blocked_axis:
            raise FormatError(
                f"{name} must be blocked along axis {blocked_axis} (its reduction axis); got a {t.format.value} "
                f"tensor blocked along axis {t.axis}"
            )
    else:
        _check_plain(name, t)
    shape = tuple(t.shape)
    _check_shape(name, shape, want, what)
    return shape


def _check_topk(config: MoeEpConfig, idx: Any, tw: Any, num_tokens: int) -> None:
    if not hasattr(idx, "dtype") or jnp.dtype(idx.dtype) not in (jnp.dtype(jnp.int32), jnp.dtype(jnp.int64)):
        raise DTypeError(
            f"topk_idx must have dtype in (int32, int64); got {_dtype_name(idx)}",
            name="topk_idx",
            expected="int32, int64",
            got=_dtype_name(idx),
        )
    shape = (num_tokens, config.num_topk)
    _check_shape("topk_idx", tuple(idx.shape), shape, "(num_tokens, num_topk)")
    if not hasattr(tw, "dtype") or jnp.dtype(tw.dtype) not in F.PLAIN_DTYPES:
        raise DTypeError(
            f"topk_weights must have dtype in (float32, float16, bfloat16); got {_dtype_name(tw)}",
            name="topk_weights",
            expected="float32, float16, bfloat16",
            got=_dtype_name(tw),
        )
    _check_shape("topk_weights", tuple(tw.shape), shape, "(num_tokens, num_topk)")


def _check_tokens(config: MoeEpConfig, num_tokens: int) -> None:
    check_num_tokens(config, num_tokens, what="num_tokens (rows of one rank's shard)")


def _check_not_batched(*args: Any) -> None:
    """vmap over these functions is not supported: the exchange's all-to-all
    would interleave the batch with the ranks. Detect it while tracing."""
    try:
        from jax._src.interpreters.batching import BatchTracer
    except ImportError:  # pragma: no cover - private API moved; no check then
        return
    for leaf in jax.tree_util.tree_leaves(args):
        if isinstance(leaf, BatchTracer):
            raise CapabilityError(
                f"{_BACKEND}: capability: jax.vmap over the MoeEp layer is not supported (its all-to-all exchange "
                f"and routing plan are per rank); fold the batch into the token axis instead ([B, T, H] -> "
                f"[B * T, H] with topk_idx [B * T, K]) and raise max_tokens_per_rank",
                feature="vmap",
            )


def _spec(
    config: MoeEpConfig, axis_name: Any, num_tokens: int, exchange: Optional[str], kernels: Any
) -> core.LayerSpec:
    if not isinstance(config, MoeEpConfig):
        raise ConfigError(f"config must be a MoeEpConfig; got {type(config).__name__}", field="config", value=config)
    _check_axis(config, axis_name)
    ex = default_exchange() if exchange in (None, "auto") else exchange
    if ex not in core.EXCHANGES:
        raise ConfigError(
            f"exchange must be 'auto' or one of {', '.join(core.EXCHANGES)}; got {exchange!r}", field="exchange", value=exchange
        )
    _check_tokens(config, num_tokens)
    return core.LayerSpec(
        config=config,
        axis_name=axis_name,
        num_tokens=int(num_tokens),
        capacity=core.buffer_rows(config, num_tokens),
        exchange=ex,
        kernels=DEFAULT_KERNELS if kernels is None else kernels,
    )


def _zero_like(x: Any) -> Any:
    """A 0-d array carrying ``x``'s dtype (for casting cotangents), or None."""
    return None if isinstance(x, F.BlockScaled) else jnp.zeros((), x.dtype)


def _cast(g: jax.Array, proto: Any) -> Any:
    return None if proto is None else g.astype(proto.dtype)


# ----------------------------------------------------------------------------- the handle


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class EpHandle:
    """The routing plan of one rank, made by :func:`ep_dispatch` and used by
    :func:`ep_combine` (a pytree: array leaves, the layer's static description
    as auxiliary data, so it can leave and re-enter ``jax.shard_map`` and ``jit``).

    Attributes:
        plan: the :class:`~moe_ep_jax.core.Plan` (send order, route positions,
            the gathered routes table).
        route_metadata: ``[C, 4] int32`` ``(local_expert, src_rank, src_token,
            src_slot)`` of every buffer row; -1 rows are padding.
        tokens_per_expert: ``[E_local] int32``: valid rows of every local expert.
        expert_offsets: ``[E_local + 1] int32``: expert ``e``'s slab starts at
            ``expert_offsets[e]`` (a multiple of ``expert_alignment``);
            ``expert_offsets[-1]`` ends the last slab.
        valid: ``[C] bool``: rows that carry a route.
        error: ``[1] bool``: a bad expert id or a buffer overflow on some rank
            (the results are NaN then).
        spec: the static :class:`~moe_ep_jax.core.LayerSpec` (auxiliary data).
    """

    plan: core.Plan
    route_metadata: jax.Array
    tokens_per_expert: jax.Array
    expert_offsets: jax.Array
    valid: jax.Array
    error: jax.Array
    spec: core.LayerSpec

    def tree_flatten(self):  # type: ignore[no-untyped-def]
        return (self.plan, self.route_metadata, self.tokens_per_expert, self.expert_offsets, self.valid, self.error), self.spec

    @classmethod
    def tree_unflatten(cls, spec, children):  # type: ignore[no-untyped-def]
        return cls(*children, spec=spec)


def _handle(spec: core.LayerSpec, plan: core.Plan, route: jax.Array) -> EpHandle:
    lay = core.layout(spec, plan)
    valid, _, _ = core.valid_rows(spec, lay)
    return EpHandle(
        plan=plan,
        route_metadata=core.route_metadata(spec, lay, route),
        tokens_per_expert=lay.tokens_per_expert,
        expert_offsets=lay.offsets,
        valid=valid,
        error=lay.error[None],
        spec=spec,
    )


# ----------------------------------------------------------------------------- fused layer


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(spec: core.LayerSpec, x: Tensor, fc1: Tensor, fc2: Tensor, idx: jax.Array, tw: jax.Array):  # type: ignore[no-untyped-def]
    """``(output, fc1_c, route_metadata)`` with ``config.generate_c``, else ``(output,)``:
    a forward nobody differentiates asks for no stash (the provider need not write it)."""
    stash = spec.config.generate_c
    out, fc1_c, meta, _, _ = core.forward(spec, x, fc1, fc2, idx, tw, stash=stash)
    return (out, fc1_c, meta) if stash else (out,)


def _fused_fwd(spec, x, fc1, fc2, idx, tw):  # type: ignore[no-untyped-def]
    out, fc1_c, meta, plan, d = core.forward(spec, x, fc1, fc2, idx, tw)  # the backward's stash, always
    res = (plan, d.tokens, d.weights, fc1_c, fc1, fc2, _zero_like(x), _zero_like(tw))
    return ((out, fc1_c, meta) if spec.config.generate_c else (out,)), res


def _fused_bwd(spec, res, cts):  # type: ignore[no-untyped-def]
    plan, x_buf, w_buf, fc1_c, fc1, fc2, x_proto, tw_proto = res
    if spec.config.output_format is not MoeFormat.BF16:
        raise CapabilityError(
            f"{_BACKEND}: capability: jax.grad through moe_ep needs output_format bf16; got "
            f"{spec.config.output_format.value} (its codes are not differentiable); use moe_ep_backward for the "
            f"spec's straight-through gradient",
            feature="autograd",
        )
    ct_out = cts[0]
    lay = core.layout(spec, plan)
    (dy_buf,) = core.tokens_to_experts(spec, plan, lay, [ct_out])
    # bf16 weights: a provider that can write bf16 weight gradients itself (jax-ffi's native
    # layer, rounding in its GEMMs' epilogue) is asked to: no float32 weight gradient is
    # written, core.poison's select stays in bf16 and the astype below is a no-op.
    to_bf16 = getattr(spec.kernels, "with_bf16_weight_grads", None)
    bf16 = jnp.dtype(jnp.bfloat16)
    if to_bf16 is not None and all(not isinstance(t, F.BlockScaled) and jnp.dtype(t.dtype) == bf16 for t in (fc1, fc2)):
        spec = replace(spec, kernels=to_bf16())
    gx, g1, g2, gw = core.backward_from_buffers(spec, plan, lay, x_buf, w_buf, fc1, fc2, fc1_c, dy_buf,
                                                grad_x_dtype=None if x_proto is None else x_proto.dtype)
    g1 = None if isinstance(fc1, F.BlockScaled) else g1.astype(fc1.dtype)
    g2 = None if isinstance(fc2, F.BlockScaled) else g2.astype(fc2.dtype)
    return _cast(gx, x_proto), g1, g2, None, _cast(gw, tw_proto)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _check_layer(config: MoeEpConfig, x: Any, fc1: Any, fc2: Any, idx: Any, tw: Any) -> int:
    h, i, el = config.hidden, config.intermediate, config.num_local_experts
    num_tokens = _check_tensor("activation", x, (None, h), "(num_tokens, hidden)", 1)[0]
    _check_tensor("fc1_weight", fc1, (el, h, 2 * i), "(num_local_experts, hidden, 2 * intermediate)", 1)
    _check_tensor("fc2_weight", fc2, (el, i, h), "(num_local_experts, intermediate, hidden)", 1)
    _check_topk(config, idx, tw, num_tokens)
    return num_tokens


def moe_ep(activation: Tensor, fc1_weight: Tensor, fc2_weight: Tensor, topk_idx: jax.Array, topk_weights: jax.Array, *,
           config: MoeEpConfig, axis_name: str = "ep", exchange: Optional[str] = None, kernels: Any = None) -> Any:
    """The MoeEp layer on this rank (collective over ``axis_name``; call inside
    ``jax.shard_map``). Differentiable (``jax.custom_vjp``) for bf16 output.

    Args:
        activation: ``[T, H]`` float32/float16/bfloat16, or a
            :class:`~moe_ep_jax.formats.BlockScaled` blocked along axis 1 (H):
            this rank's tokens. Padding rows (tokens that do not exist) may
            hold anything finite; give them ``topk_idx`` -1.
        fc1_weight: ``[E_local, H, 2I]`` float, or BlockScaled along axis 1 (H):
            columns ``[0, I)`` gate, ``[I, 2I)`` up.
        fc2_weight: ``[E_local, I, H]`` float, or BlockScaled along axis 1 (I).
        topk_idx: ``[T, K]`` int32/int64 in ``[-1, E)``; -1 marks an unused slot.
        topk_weights: ``[T, K]`` float32/float16/bfloat16, read as float32.
        config: the layer; ``num_ranks`` must be the size of ``axis_name``,
            and ``T <= max_tokens_per_rank`` when that is set.
        axis_name: the EP mesh axis.
        exchange: ``ragged``, ``capacity`` or None/``auto``
            (:func:`default_exchange`).
        kernels: an :class:`~moe_ep_jax.kernels.ExpertKernels` provider
            (default :class:`~moe_ep_jax.kernels.XlaKernels`).

    Returns:
        ``output``: ``[T, H] bfloat16``, or a BlockScaled blocked along axis 1
        for mxfp8/nvfp4 ``output_format``. With ``config.generate_c``, the
        tuple ``(output, fc1_c [C, 2I] bfloat16, route_metadata [C, 4] int32)``
        (the training stash; padding rows zero and -1).

    Collectives: one all-gather of ``[E + 1] int32`` and two all-to-alls
    forward; two all-to-alls backward (the plan and the dispatched rows are
    kept as residuals). Nothing else. At one rank the all-to-alls are local
    gathers.
    """
    _check_not_batched(activation, fc1_weight, fc2_weight, topk_idx, topk_weights)
    num_tokens = _check_layer(config, activation, fc1_weight, fc2_weight, topk_idx, topk_weights)
    spec = _spec(config, axis_name, num_tokens, exchange, kernels)
    outs = _fused(spec, activation, fc1_weight, fc2_weight, topk_idx.astype(jnp.int32), topk_weights)
    if config.generate_c:
        out, fc1_c, meta = outs
        return out, fc1_c, meta
    return outs[0]


def moe_ep_backward(
    grad_output: jax.Array,
    activation: Tensor,
    fc1_weight: Tensor,
    fc2_weight: Tensor,
    topk_idx: jax.Array,
    topk_weights: jax.Array,
    fc1_c: jax.Array,
    *,
    config: MoeEpConfig,
    axis_name: str = "ep",
    exchange: Optional[str] = None,
    kernels: Any = None,
) -> Tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The spec's explicit backward (section 9.2) on this rank, from the forward's
    inputs and its ``fc1_c`` stash; collective.

    Args:
        grad_output: ``[T, H]`` float32/float16/bfloat16 cotangent of the output.
        activation, fc1_weight, fc2_weight, topk_idx, topk_weights: as :func:`moe_ep`.
        fc1_c: ``[C, 2I] bfloat16``: the stash the forward returned (rows in its
            expert-major order; padding rows are not read).

    Returns:
        float32 ``(grad_activation [T, H], grad_fc1_weight [E_local, H, 2I],
        grad_fc2_weight [E_local, I, H], grad_topk_weights [T, K])``; the
        gradient of a block-scaled input is with respect to its decoded value.

    Collectives: one all-gather (the plan) and two all-to-alls (token rows,
    weights and cotangents out; ``dx`` and ``dw`` back).
    """
    _check_not_batched(grad_output, activation, fc1_weight, fc2_weight, topk_idx, topk_weights, fc1_c)
    num_tokens = _check_layer(config, activation, fc1_weight, fc2_weight, topk_idx, topk_weights)
    _check_plain("grad_output", grad_output)
    _check_shape("grad_output", tuple(grad_output.shape), (num_tokens, config.hidden), "(num_tokens, hidden)")
    spec = _spec(config, axis_name, num_tokens, exchange, kernels)
    if not hasattr(fc1_c, "dtype") or jnp.dtype(fc1_c.dtype) != jnp.dtype(jnp.bfloat16):
        raise DTypeError(f"fc1_c must have dtype bfloat16; got {_dtype_name(fc1_c)}", name="fc1_c", expected="bfloat16")
    _check_shape("fc1_c", tuple(fc1_c.shape), (spec.capacity, 2 * config.intermediate), "(receive rows, 2 * intermediate)")
    plan = core.make_plan(spec, topk_idx.astype(jnp.int32))
    lay = core.layout(spec, plan)
    d = core.dispatch(spec, plan, lay, activation, topk_weights, extra=[grad_output])
    return core.backward_from_buffers(spec, plan, lay, d.tokens, d.weights, fc1_weight, fc2_weight, fc1_c, d.extra[0])


# ----------------------------------------------------------------------------- layered


def _dispatch_impl(spec: core.LayerSpec, tokens: Tensor, idx: jax.Array, tw: jax.Array):  # type: ignore[no-untyped-def]
    plan = core.make_plan(spec, idx)
    lay = core.layout(spec, plan)
    d = core.dispatch(spec, plan, lay, tokens, tw)
    return d.tokens, d.weights, _handle(spec, plan, d.route)


_dispatch = jax.custom_vjp(_dispatch_impl, nondiff_argnums=(0,))


def _dispatch_fwd(spec, tokens, idx, tw):  # type: ignore[no-untyped-def]
    out = _dispatch_impl(spec, tokens, idx, tw)
    return out, (out[2].plan, _zero_like(tokens), _zero_like(tw))


def _dispatch_bwd(spec, res, cts):  # type: ignore[no-untyped-def]
    plan, tok_proto, tw_proto = res
    ct_tokens, ct_w, _ = cts
    if tok_proto is None:
        ct_tokens = jnp.zeros((spec.capacity, spec.config.hidden), jnp.float32)
    gt, gw = _dispatch_backward(spec, plan, ct_tokens, ct_w)
    return _cast(gt, tok_proto), None, _cast(gw, tw_proto)


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def _dispatch_backward(spec: core.LayerSpec, plan: core.Plan, ct_tokens: jax.Array, ct_w: jax.Array):  # type: ignore[no-untyped-def]
    lay = core.layout(spec, plan)
    valid, _, _ = core.valid_rows(spec, lay)
    rows = [jnp.where(valid[:, None], ct_tokens.astype(jnp.float32), 0.0), jnp.where(valid, ct_w.astype(jnp.float32), 0.0)]
    gt, gw = core.to_sources(spec, plan, lay, rows)
    grad_tokens = core.poison(lay.error, core.slot_sum(spec, gt))
    return grad_tokens, core.poison(lay.error, gw.reshape(spec.num_tokens, spec.num_topk))


def ep_dispatch(tokens: Tensor, topk_idx: jax.Array, topk_weights: jax.Array, *, config: MoeEpConfig,
                axis_name: str = "ep", exchange: Optional[str] = None,
                kernels: Any = None) -> Tuple[Tensor, jax.Array, EpHandle]:
    """Layered dispatch on this rank (collective; spec section 10.1).

    Args:
        tokens: ``[T, H]`` float32/float16/bfloat16 or BlockScaled along axis 1:
            moved unchanged (codes and scales travel bit for bit).
        topk_idx: ``[T, K]`` int32/int64 in ``[-1, E)``.
        topk_weights: ``[T, K]`` float, read as float32.
        config, axis_name, exchange, kernels: as :func:`moe_ep` (kernels are
            used by :func:`ep_combine`'s format round trips).

    Returns:
        ``(recv_tokens [C, H]`` in the tokens' encoding, ``recv_weights [C]
        float32``, :class:`EpHandle`)``: rows in expert-major order (local
        expert, source rank, source token, slot); padding rows zero (codes and
        scales zero), weight 0, metadata -1.

    Differentiable with respect to plain ``tokens`` and ``topk_weights``: the
    backward is the spec's ``dispatch_backward`` (a combine of the cotangents
    without rounding). Collectives: one all-gather, one all-to-all (and one
    all-to-all backward).
    """
    _check_not_batched(tokens, topk_idx, topk_weights)
    num_tokens = _check_tensor("tokens", tokens, (None, config.hidden), "(num_tokens, hidden)", 1)[0]
    _check_topk(config, topk_idx, topk_weights, num_tokens)
    spec = _spec(config, axis_name, num_tokens, exchange, kernels)
    return _dispatch(spec, tokens, topk_idx.astype(jnp.int32), topk_weights)


def _combine_impl(spec: core.LayerSpec, expert_out: jax.Array, plan: core.Plan):  # type: ignore[no-untyped-def]
    lay = core.layout(spec, plan)
    out, _ = core.combine_rows(spec, plan, lay, expert_out.astype(jnp.float32))
    return out


_combine = jax.custom_vjp(_combine_impl, nondiff_argnums=(0,))


def _combine_fwd(spec, expert_out, plan):  # type: ignore[no-untyped-def]
    return _combine_impl(spec, expert_out, plan), (plan, _zero_like(expert_out))


def _combine_bwd(spec, res, ct):  # type: ignore[no-untyped-def]
    plan, proto = res
    if spec.config.output_format is not MoeFormat.BF16:
        raise CapabilityError(
            f"{_BACKEND}: capability: jax.grad through ep_combine needs output_format bf16; got "
            f"{spec.config.output_format.value}; use combine_backward for the spec's straight-through gradient",
            feature="autograd",
        )
    return _cast(_combine_backward(spec, plan, ct), proto), None


_combine.defvjp(_combine_fwd, _combine_bwd)


def _combine_backward(spec: core.LayerSpec, plan: core.Plan, ct_out: jax.Array) -> jax.Array:
    lay = core.layout(spec, plan)
    (rows,) = core.tokens_to_experts(spec, plan, lay, [ct_out.astype(jnp.float32)])
    valid, _, _ = core.valid_rows(spec, lay)
    return core.poison(lay.error, jnp.where(valid[:, None], rows, 0.0))


def _handle_spec(handle: Any, config: Optional[MoeEpConfig], name: str = "handle") -> core.LayerSpec:
    if not isinstance(handle, EpHandle):
        raise DTypeError(f"{name} must be the EpHandle ep_dispatch returned; got {type(handle).__name__}", name=name)
    spec = handle.spec
    if config is not None and config != spec.config:
        raise ConfigError(
            f"config must be the configuration of the dispatch that made {name}; got {config!r}, the dispatch used "
            f"{spec.config!r}",
            field="config",
        )
    _check_axis(spec.config, spec.axis_name)
    return spec


def ep_combine(expert_out: jax.Array, handle: EpHandle, *, config: Optional[MoeEpConfig] = None) -> Tensor:
    """Layered combine on this rank (collective; spec section 10.2).

    Args:
        expert_out: ``[C, H]`` float32/float16/bfloat16, rows as dispatched
            (padding rows are never read: their content, NaN included, has no effect).
        handle: the :class:`EpHandle` of the dispatch.
        config: optional; must equal the dispatch's configuration.

    Returns:
        ``[T, H]`` in ``output_format``: per row the ``combine_format`` round
        trip, back to (token, slot), slot-order float32 sum, one encode.
        Unweighted. Differentiable (bf16 output): the backward is the spec's
        ``combine_backward``. Collectives: one all-to-all (and one backward).
    """
    _check_not_batched(expert_out, handle)
    spec = _handle_spec(handle, config)
    _check_plain("expert_out", expert_out)
    _check_shape("expert_out", tuple(expert_out.shape), (spec.capacity, spec.config.hidden), "(receive rows, hidden)")
    return _combine(spec, expert_out, handle.plan)


def dispatch_backward(
    grad_tokens: jax.Array, grad_topk_weights: jax.Array, handle: EpHandle
) -> Tuple[jax.Array, jax.Array]:
    """The spec's ``dispatch_backward`` on this rank (collective): ``[C, H]`` and
    ``[C]`` float cotangents -> float32 ``(grad_tokens [T, H], grad_topk_weights
    [T, K])``. Padding rows are ignored; -1 slots get exactly 0."""
    spec = _handle_spec(handle, None)
    _check_plain("grad_tokens", grad_tokens)
    _check_shape("grad_tokens", tuple(grad_tokens.shape), (spec.capacity, spec.config.hidden), "(receive rows, hidden)")
    _check_plain("grad_topk_weights", grad_topk_weights)
    _check_shape("grad_topk_weights", tuple(grad_topk_weights.shape), (spec.capacity,), "(receive rows,)")
    return _dispatch_backward(spec, handle.plan, grad_tokens, grad_topk_weights)


def combine_backward(grad_output: jax.Array, handle: EpHandle) -> jax.Array:
    """The spec's ``combine_backward`` on this rank (collective): ``[T, H]`` float
    -> ``[C, H] float32``, row i the cotangent of its source token, padding rows zero."""
    spec = _handle_spec(handle, None)
    _check_plain("grad_output", grad_output)
    _check_shape("grad_output", tuple(grad_output.shape), (spec.num_tokens, spec.config.hidden), "(num_tokens, hidden)")
    return _combine_backward(spec, handle.plan, grad_output)


# ----------------------------------------------------------------------------- helpers


def shard_moe_ep(
    config: MoeEpConfig,
    mesh: Any,
    *,
    axis_name: str = "ep",
    exchange: Optional[str] = None,
    kernels: Any = None,
) -> Any:
    """:func:`moe_ep` wrapped in ``jax.shard_map`` over ``mesh`` (every input and
    output sharded along its leading axis over ``axis_name``): a function of the
    GLOBAL arrays ``activation [num_ranks * T, H]``, ``fc1_weight [E, H, 2I]``,
    ``fc2_weight [E, I, H]``, ``topk_idx`` and ``topk_weights [num_ranks * T, K]``.

    Raises:
        ConfigError: the mesh has no axis ``axis_name``, or its size is not
            ``config.num_ranks``.
    """
    names = tuple(getattr(mesh, "axis_names", ()))
    if axis_name not in names:
        raise ConfigError(
            f"mesh must have the EP axis {axis_name!r} (of size num_ranks = {config.num_ranks}); got a mesh with "
            f"axes {names}",
            field="axis_name",
            value=axis_name,
        )
    size = dict(mesh.shape)[axis_name]
    if size != config.num_ranks:
        raise ConfigError(
            f"the size of mesh axis {axis_name!r} must equal num_ranks = {config.num_ranks}; got {size}",
            field="num_ranks",
            value=size,
        )
    spec = jax.sharding.PartitionSpec(axis_name)
    fn = partial(moe_ep, config=config, axis_name=axis_name, exchange=exchange, kernels=kernels)
    return jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)


def check_routing(config: MoeEpConfig, topk_idx: Sequence[Any]) -> None:
    """Host-side check of one ``[T, K]`` ``topk_idx`` per rank: raises
    :class:`RoutingIndexError` for an id outside ``[-1, E)`` and
    :class:`CapacityError` when a rank's aligned receive rows exceed
    ``recv_capacity`` (the two errors that turn results to NaN inside jit)."""
    n, el, e = config.num_ranks, config.num_local_experts, config.num_experts
    totals = np.zeros((n, el), dtype=np.int64)
    for r, idx in enumerate(topk_idx):
        a = np.asarray(idx)
        bad = (a < -1) | (a >= e)
        if bad.any():
            t, k = (int(i) for i in np.argwhere(bad)[0])
            raise RoutingIndexError(
                f"rank {r}: topk_idx values must be in [-1, num_experts) = [-1, {e}); got {int(a[t, k])} at "
                f"(token {t}, slot {k})",
                rank=r,
                position=(t, k),
                value=int(a[t, k]),
                num_experts=e,
            )
        g = a[a >= 0].astype(np.int64)
        totals += np.bincount(g, minlength=e).reshape(n, el)
    if config.recv_capacity is None:
        return
    align = config.expert_alignment
    rows = (-(-totals // align) * align).sum(axis=1)
    for d in range(n):
        if rows[d] > config.recv_capacity:
            raise CapacityError(
                f"rank {d}: received rows after aligning every expert's slab to expert_alignment = {align} must be "
                f"<= recv_capacity = {config.recv_capacity}; got {int(rows[d])} ({int(totals[d].sum())} routes, per "
                f"local expert {totals[d].tolist()})",
                limit=config.recv_capacity,
                got=int(rows[d]),
            )
