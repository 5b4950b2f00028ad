"""The golden data of the bf16-operand backward (``backward_operand_format = "bf16"``).

An independent implementation of spec section 9.2 in that mode, written from the
spec text alone: it does not import ``moe_ep_reference``, and it rounds to bf16
with its own few lines (:func:`rne_bf16`, Python's correctly rounded half-even
``round`` on the exactly scaled float64 value). The stash it starts from comes
from :func:`naive.naive_forward`, the tests' other independent implementation.

Everything is a plain loop over the received rows of every destination rank, in
float64, with exactly rounded sums (:func:`_dot`: ``math.fsum``) and ``math.exp``, so
the file is the same on every machine (a BLAS dot and numpy's vectorised ``exp`` follow
the CPU's instruction set in their last bits). ``python tests/golden_backward_bf16.py`` rewrites
``tests/data/golden_backward_bf16.npz`` (see ``tests/data/golden_backward_bf16.README.md``).

Two of the cases are built so that ``dc`` and ``w * h`` land exactly on bf16
rounding ties, where round-to-nearest-even and every other tie rule differ: the
gate values are 64 (so ``sigmoid`` is exactly 1 in float64 and in float32, ``s =
g`` and ``silu'`` is exactly ``u``), the activations one-hot, and the router
weights, ``u`` and ``dY W2^T`` small bf16 combinations such as ``1 + 2^-8``. Every
value there is exact in float32 too, so a conforming backend has no latitude.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np

from moe_ep_spec.api import RankInputs
from moe_ep_spec.config import MoeEpConfig
from moe_ep_spec.formats import BF16
from moe_ep_spec.inputs import random_world

try:  # tests/ may or may not be a package
    from . import naive
except ImportError:
    import naive

__all__ = ["GOLDEN", "CASES", "rne_bf16", "is_bf16_tie", "bf16_backward", "build_case", "load", "main"]

GOLDEN = Path(__file__).parent / "data" / "golden_backward_bf16.npz"
GRADS = ("grad_activation", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights")
INPUTS = ("activation", "fc1_weight", "fc2_weight", "topk_idx", "topk_weights")


def _rne_scalar(x: float) -> float:
    if not math.isfinite(x) or x == 0.0:
        return x
    _, e = math.frexp(abs(x))  # |x| = m * 2^e, 0.5 <= m < 1
    q = max(e - 8, -133)  # 8 significant bits; bf16's smallest subnormal is 2^-133
    r = math.ldexp(float(round(math.ldexp(x, -q))), q)  # round(): half to even, exact on the scaled value
    return math.copysign(math.inf if abs(r) >= 2.0**128 else r, x)  # a tiny value keeps its sign at 0


def _dot(a, b) -> float:
    """sum_i a_i b_i, exactly rounded (math.fsum of the float64 products): the same bits on every
    machine, unlike a BLAS dot whose kernel (and summation order) follows the CPU."""
    return math.fsum((np.asarray(a, dtype=np.float64) * np.asarray(b, dtype=np.float64)).tolist())


def _matvec(m, v) -> np.ndarray:
    """m @ v, each row by _dot."""
    return np.array([_dot(row, v) for row in np.asarray(m, dtype=np.float64)], dtype=np.float64)


def rne_bf16(values) -> np.ndarray:
    """Round to bf16, nearest, ties to even, as float64 (overflow to +-inf)."""
    v = np.asarray(values, dtype=np.float64)
    return np.vectorize(_rne_scalar, otypes=[np.float64])(v) if v.size else v.copy()


def is_bf16_tie(values) -> np.ndarray:
    """Where a float64 value lies exactly halfway between two bf16 neighbours."""
    v = np.asarray(values, dtype=np.float64)
    out = np.zeros(v.shape, dtype=bool)
    for i, x in np.ndenumerate(v):
        if math.isfinite(x) and x != 0.0:
            _, e = math.frexp(abs(x))
            scaled = math.ldexp(abs(x), -max(e - 8, -133))
            out[i] = scaled - math.floor(scaled) == 0.5
    return out


def bf16_backward(
    config: MoeEpConfig,
    inputs: Sequence[RankInputs],
    grad_output: Sequence[np.ndarray],
    fc1_c: Sequence[np.ndarray],
    route_metadata: Sequence[np.ndarray],
) -> Dict[str, List[np.ndarray]]:
    """Section 9.2 with ``backward_operand_format = bf16``, one received row at a time.

    Returns per gradient name one float64 array per rank, and under ``"dc"`` and
    ``"wh"`` the float64 ``dc`` (``[R, 2I]``) and ``w * h`` (``[R, I]``) of every
    destination's rows before their bf16 rounding (zero in padding rows).
    """
    i_size, limit = config.intermediate, config.gate_up_clamp
    xs = [naive.decode(inp.activation) for inp in inputs]
    ws = [np.asarray(inp.topk_weights).astype(np.float32).astype(np.float64) for inp in inputs]
    dys = [rne_bf16(np.asarray(g).astype(np.float64)) for g in grad_output]  # dY_b = R_bf16(dY)
    fc1 = [naive.decode(inp.fc1_weight) for inp in inputs]
    fc2 = [naive.decode(inp.fc2_weight) for inp in inputs]
    out: Dict[str, List[np.ndarray]] = {
        "grad_activation": [np.zeros_like(x) for x in xs],
        "grad_fc1_weight": [np.zeros_like(f) for f in fc1],
        "grad_fc2_weight": [np.zeros_like(f) for f in fc2],
        "grad_topk_weights": [np.zeros(np.shape(inp.topk_idx), dtype=np.float64) for inp in inputs],
        "dc": [],
        "wh": [],
    }
    for d in range(len(inputs)):
        stash = np.asarray(fc1_c[d]).astype(np.float64)
        meta = np.asarray(route_metadata[d])
        dc_rows = np.zeros((meta.shape[0], 2 * i_size))
        wh_rows = np.zeros((meta.shape[0], i_size))
        for j, (le, src, t, k) in enumerate(meta.tolist()):
            if le < 0:
                continue
            x, w, dy_b = xs[src][t], ws[src][t, k], dys[src][t]
            w1, w2 = fc1[d][le], fc2[d][le]
            g, u = stash[j, :i_size], stash[j, i_size:]
            m_g = np.ones(i_size) if limit is None else (g <= limit).astype(np.float64)
            m_u = np.ones(i_size) if limit is None else ((u >= -limit) & (u <= limit)).astype(np.float64)
            if limit is not None:
                g, u = np.minimum(g, limit), np.minimum(np.maximum(u, -limit), limit)
            sig = 1.0 / (1.0 + np.array([math.exp(v) for v in (-g).tolist()]))
            s = g * sig
            h = s * u
            a = _matvec(w2, dy_b)  # dY_b W2^T
            wh = w * h
            out["grad_fc2_weight"][d][le] += np.outer(rne_bf16(wh), dy_b)  # both placements
            dw = _dot(a, h) if config.apply_topk_in_fc1 else _dot(dy_b, _matvec(w2.T, h))
            dh = w * a
            dc = np.concatenate([dh * u * sig * (1.0 + g * (1.0 - sig)) * m_g, dh * s * m_u])
            dc_b = rne_bf16(dc)
            out["grad_fc1_weight"][d][le] += np.outer(x, dc_b)
            out["grad_activation"][src][t] += _matvec(w1, dc_b)
            out["grad_topk_weights"][src][t, k] = dw
            dc_rows[j], wh_rows[j] = dc, wh
        out["dc"].append(dc_rows)
        out["wh"].append(wh_rows)
    return out


# ------------------------------------------------------------------ the cases


def _tie_world(config: MoeEpConfig) -> List[RankInputs]:
    """One rank, two experts, eight tokens: ``dc`` and ``w * h`` full of exact bf16 ties."""
    h_size, i_size, t_size = config.hidden, config.intermediate, 8
    x = np.zeros((t_size, h_size), np.float32)
    x[np.arange(t_size), np.arange(t_size) % h_size] = 1.0  # one-hot: c = x W1 is a row of W1
    us = np.array([1.0, -1.0, 1.0 + 2.0**-7, 0.5, -1.5, 2.0, 1.0, -0.75], np.float64)
    fc1 = np.zeros((2, h_size, 2 * i_size), np.float64)
    for e in range(2):
        for j in range(h_size):
            gate = np.full(i_size, 64.0)
            gate[(j + e) % i_size] = 0.5 if j % 2 else -1.25  # one generic sigmoid per row
            fc1[e, j] = np.concatenate([gate, np.roll(us, j + e)[:i_size]])
    # a = dY_b W2^T: dY_b starts [1, 2^-8, 2^-7]; W2 rows combine them into 1, 1 + 2^-8,
    # 1 + 3 2^-8, 1 + 2^-7 (and their negatives); the other columns only reach dW2.
    combos = np.array([[1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 0, 1], [-1, 0, 0], [-1, -1, 0], [1, 1, 0], [1, 1, 1]])
    fc2 = np.zeros((2, i_size, h_size), np.float64)
    for e in range(2):
        fc2[e, :, :3] = np.roll(combos[:i_size], e, axis=0)
    idx = np.array([[t % 2, (t + 1) % 2] for t in range(t_size)], np.int32)
    idx[5, 1] = -1
    weights = np.array([[1.0, 1.0 + 2.0**-8], [1.0 + 3 * 2.0**-8, 1.0], [1.0 + 2.0**-8, 0.75], [1.0, 1.0],
                        [0.5 + 2.0**-9, 1.0 + 2.0**-8], [1.0 + 2.0**-8, 2.0], [1.0, 1.0 + 3 * 2.0**-8],
                        [1.0 + 2.0**-8, 1.0 + 2.0**-8]], np.float32)
    return [RankInputs(x.astype(BF16), fc1.astype(np.float32).astype(BF16), fc2.astype(np.float32).astype(BF16), idx,
                       weights)]


def _tie_grad(t_size: int, hidden: int, seed: int) -> List[np.ndarray]:
    """float32 cotangents whose bf16 rounding starts [1, 2^-8, 2^-7] (through a tie and a
    round-down), then random values that only reach dW2."""
    rng = np.random.default_rng(seed)
    g = rng.normal(size=(t_size, hidden)).astype(np.float32)
    g[:, 0] = 1.0 + 2.0**-9  # rounds down to 1
    g[:, 1] = 2.0**-8 * (1.0 + 2.0**-8)  # a tie: to even, 2^-8
    g[:, 2] = 2.0**-7
    return [g]


CASES = ("ties_weights_in_fc1", "ties_weights_in_fc2", "random_ep2_clamp", "random_ep2_static_bf16_cotangent")


def build_case(name: str):
    """``(config, inputs, grad_output)`` of a golden case (deterministic)."""
    if name.startswith("ties_"):
        config = MoeEpConfig(num_experts=2, hidden=16, intermediate=8, num_topk=2, generate_c=True,
                             apply_topk_in_fc1=name == "ties_weights_in_fc1", backward_operand_format="bf16")
        return config, _tie_world(config), _tie_grad(8, config.hidden, seed=11)
    if name == "random_ep2_clamp":
        config = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=2, generate_c=True,
                             apply_topk_in_fc1=False, gate_up_clamp=1.5, backward_operand_format="bf16")
        world = random_world(config, num_tokens=[5, 3], seed=21)
        rng = np.random.default_rng(22)
        return config, world, [rng.normal(size=(w.topk_idx.shape[0], 32)).astype(np.float32) for w in world]
    if name == "random_ep2_static_bf16_cotangent":
        base = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=3, num_ranks=2, generate_c=True,
                           max_tokens_per_rank=6, backward_operand_format="bf16")
        config = base.replace(recv_capacity=40, expert_alignment=4)
        world = random_world(config, num_tokens=[6, 0], routing="unused_mixed", seed=31)
        rng = np.random.default_rng(32)
        return config, world, [rng.normal(size=(w.topk_idx.shape[0], 32)).astype(BF16) for w in world]
    raise KeyError(name)


def _config_json(config: MoeEpConfig) -> str:
    fields = {k: (v.value if hasattr(v, "value") else v) for k, v in vars(config).items()}
    return json.dumps(fields, sort_keys=True)


def _store(a) -> np.ndarray:
    a = np.asarray(a)
    return a.astype(np.float32) if a.dtype == BF16 else a


def generate() -> Dict[str, np.ndarray]:
    """Every case's inputs, stash, cotangent and golden gradients, as npz entries."""
    data: Dict[str, np.ndarray] = {}
    for name in CASES:
        config, world, grad = build_case(name)
        fwd = naive.naive_forward(config, world)
        golden = bf16_backward(config, world, grad, [f.fc1_c for f in fwd], [f.route_metadata for f in fwd])
        data[f"{name}/config"] = np.array(_config_json(config))
        for r, inp in enumerate(world):
            p = f"{name}/rank{r}/"
            for field in INPUTS:
                value = np.asarray(getattr(inp, field))
                data[p + field] = _store(value)
                data[p + field + "_dtype"] = np.array(value.dtype.name)
            data[p + "grad_output"] = _store(grad[r])
            data[p + "grad_output_dtype"] = np.array(np.asarray(grad[r]).dtype.name)
            data[p + "fc1_c"] = _store(fwd[r].fc1_c)
            data[p + "route_metadata"] = fwd[r].route_metadata.astype(np.int32)
            for key in GRADS + ("dc", "wh"):
                data[p + "golden_" + key] = golden[key][r]
    return data


def load(path: Path = GOLDEN):
    """The stored cases: ``{name: (config, inputs, grad_output, fc1_c, route_metadata, golden)}``,
    ``golden`` a dict of per-rank float64 arrays (the four gradients, ``dc``, ``wh``)."""
    raw = np.load(path)
    out = {}
    for name in CASES:
        fields = json.loads(str(raw[f"{name}/config"]))
        config = MoeEpConfig(**fields)
        inputs, grads, stash_c, stash_m = [], [], [], []
        golden: Dict[str, List[np.ndarray]] = {k: [] for k in GRADS + ("dc", "wh")}
        for r in range(config.num_ranks):
            p = f"{name}/rank{r}/"

            def get(field):
                return raw[p + field].astype(np.dtype(BF16) if str(raw[p + field + "_dtype"]) == "bfloat16"
                                             else np.dtype(str(raw[p + field + "_dtype"])))

            inputs.append(RankInputs(*(get(f) for f in INPUTS)))
            grads.append(get("grad_output"))
            stash_c.append(raw[p + "fc1_c"].astype(BF16))
            stash_m.append(raw[p + "route_metadata"])
            for key in golden:
                golden[key].append(raw[p + "golden_" + key])
        out[name] = (config, inputs, grads, stash_c, stash_m, golden)
    return out


def main(argv: Sequence[str] = ()) -> int:
    path = Path(argv[0]) if argv else GOLDEN
    np.savez_compressed(path, **generate())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
