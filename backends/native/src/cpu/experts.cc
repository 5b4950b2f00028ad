// CPU grouped SwiGLU expert MLP, forward and backward (docs/spec.md 5 and 9.2).
// Every product and sum is float32 (compiled with -ffp-contract=off: no fused
// multiply-add, so each product rounds on its own); GEMMs accumulate in
// ascending order of the contracted index.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cpu/formats.h"
#include "internal.h"

namespace moe_ep {
namespace cpu {
namespace {

// Slab offsets [E + 1] from group_sizes; rejects a negative size or a sum past num_rows.
moe_ep_status slab_offsets(const char* op, const moe_ep_expert_desc& d, const int32_t* group_sizes,
                           std::vector<int64_t>* off) {
  off->assign(static_cast<size_t>(d.num_local_experts) + 1, 0);
  for (int64_t e = 0; e < d.num_local_experts; ++e) {
    if (group_sizes[e] < 0)
      return fail(MOE_EP_ERR_INVALID_ARGUMENT, std::string(op) + ": group_sizes[" + std::to_string(e) + "] must be >= 0; got " +
                                                   std::to_string(group_sizes[e]));
    (*off)[e + 1] = (*off)[e] + group_sizes[e];
  }
  if (off->back() > d.num_rows)
    return fail(MOE_EP_ERR_INVALID_ARGUMENT, std::string(op) + ": sum(group_sizes) must be <= num_rows = " + std::to_string(d.num_rows) +
                                                 "; got " + std::to_string(off->back()));
  return MOE_EP_OK;
}

// out[r, :] = a[r, :] @ b  for one row: a [K], b [K, N] row-major, out [N].
void row_gemm(const float* a, const float* b, int64_t K, int64_t N, float* out) {
  std::fill(out, out + N, 0.0f);
  for (int64_t k = 0; k < K; ++k) {
    const float av = a[k];
    const float* brow = b + k * N;
    for (int64_t j = 0; j < N; ++j) out[j] = out[j] + av * brow[j];
  }
}

// out[r, :] = a[r, :] @ b^T for one row: a [N], b [K, N] row-major, out [K].
void row_gemm_t(const float* a, const float* b, int64_t K, int64_t N, float* out) {
  for (int64_t k = 0; k < K; ++k) {
    const float* brow = b + k * N;
    float acc = 0.0f;
    for (int64_t j = 0; j < N; ++j) acc = acc + a[j] * brow[j];
    out[k] = acc;
  }
}

// out [K, N] += a[r, :]^T b[r, :] over rows r0..r1 (a [*, K], b [*, N]), accumulated row by row.
void slab_outer(const float* a, const float* b, int64_t r0, int64_t r1, int64_t K, int64_t N, float* out) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* ar = a + r * K;
    const float* br = b + r * N;
    for (int64_t k = 0; k < K; ++k) {
      const float av = ar[k];
      float* orow = out + k * N;
      for (int64_t j = 0; j < N; ++j) orow[j] = orow[j] + av * br[j];
    }
  }
}

inline float sigmoid(float g) { return 1.0f / (1.0f + std::exp(-g)); }

// R_bf16: the bf16 rounding (nearest, ties to even) as a float32 value.
inline float round_bf16(float v) { return bf16_to_float(bf16_from_float(v)); }

}  // namespace

moe_ep_status expert_forward(void*, const moe_ep_expert_desc& d, const float* x, const float* w, const float* fc1,
                             const float* fc2, const int32_t* group_sizes, float* y, float* c, void* workspace) {
  std::vector<int64_t> off;
  moe_ep_status st = slab_offsets("moe_ep_expert_forward", d, group_sizes, &off);
  if (st != MOE_EP_OK) return st;
  const int64_t C = d.num_rows, H = d.hidden, I = d.intermediate;
  ForwardWorkspace ws;
  forward_workspace_layout(d, workspace, &ws);
  float* op = ws.op;  // [C, I]: the FC2 operand
  std::vector<uint8_t> qdata, qscale;
  const float lim = d.gate_up_clamp;
  for (int64_t e = 0; e < d.num_local_experts; ++e) {
    const float* w1 = fc1 + e * H * 2 * I;
    const float* w2 = fc2 + e * I * H;
    for (int64_t r = off[e]; r < off[e + 1]; ++r) {
      float* cr = c + r * 2 * I;
      row_gemm(x + r * H, w1, H, 2 * I, cr);  // FC1
      float* opr = op + r * I;
      for (int64_t i = 0; i < I; ++i) {
        float g = cr[i], u = cr[I + i];
        if (d.has_clamp) {
          g = std::min(g, lim);
          u = std::min(std::max(u, -lim), lim);
        }
        const float s = g * sigmoid(g);
        const float h = s * u;
        opr[i] = d.apply_topk_in_fc1 ? w[r] * h : h;
      }
      st = round_trip_row(d.intermediate_format, opr, I, &qdata, &qscale);
      if (st != MOE_EP_OK) return st;
      float* yr = y + r * H;
      row_gemm(opr, w2, I, H, yr);  // FC2
      if (!d.apply_topk_in_fc1)
        for (int64_t j = 0; j < H; ++j) yr[j] = w[r] * yr[j];
    }
  }
  for (int64_t r = off.back(); r < C; ++r) {  // rows of no expert: zero
    std::fill(y + r * H, y + (r + 1) * H, 0.0f);
    std::fill(c + r * 2 * I, c + (r + 1) * 2 * I, 0.0f);
  }
  return MOE_EP_OK;
}

// backward_operand_format bf16 (opt.bf16_operands): dY enters as R_bf16(dY), dc as R_bf16(dc) (the
// operand of dW1 and dx), dW2 += R_bf16(w h)^T R_bf16(dY) and dw = <a, h> in both placements.
// opt.accumulate: each expert's weight gradients are computed as without it, then added to dfc1/dfc2.
// An expert's gradients are written after the last read of its weights, so dfc1 / dfc2 may be
// fc1 / fc2 themselves (layer.cc's bf16 weight gradients: the staged weights as float32 scratch).
moe_ep_status expert_backward(void*, const moe_ep_expert_desc& d, const float* x, const float* w, const float* fc1,
                              const float* fc2, const uint16_t* fc1_c, const float* dy, const int32_t* group_sizes,
                              float* dx, float* dw, float* dfc1, float* dfc2, void* workspace,
                              const BackwardOptions& opt) {
  std::vector<int64_t> off;
  moe_ep_status st = slab_offsets("moe_ep_expert_backward", d, group_sizes, &off);
  if (st != MOE_EP_OK) return st;
  const int64_t C = d.num_rows, H = d.hidden, I = d.intermediate, E = d.num_local_experts;
  const float lim = d.gate_up_clamp;
  // Workspace: lhs of the dfc2 GEMM [C, I], rhs of it [C, H], dc [C, 2I], a row of z [H].
  BackwardWorkspace ws;
  backward_workspace_layout(d, workspace, &ws);
  float* p_lhs = ws.h;   // [C, I]
  float* p_rhs = ws.z;   // [C, H]
  float* dc = ws.dc;     // [C, 2I]
  const bool b16 = opt.bf16_operands;
  std::vector<float> a(static_cast<size_t>(I)), h(static_cast<size_t>(I)), z(static_cast<size_t>(H));
  std::vector<float> dyb(b16 ? static_cast<size_t>(H) : 0);
  // With accumulate: one expert's gradients, then added to dfc1 / dfc2.
  std::vector<float> g1(opt.accumulate ? static_cast<size_t>(H * 2 * I) : 0),
      g2(opt.accumulate ? static_cast<size_t>(I * H) : 0);
  for (int64_t e = 0; e < E; ++e) {
    const float* w1 = fc1 + e * H * 2 * I;
    const float* w2 = fc2 + e * I * H;
    for (int64_t r = off[e]; r < off[e + 1]; ++r) {
      const float* dyr = dy + r * H;
      if (b16) {  // R_bf16(dY)
        for (int64_t j = 0; j < H; ++j) dyb[j] = round_bf16(dyr[j]);
        dyr = dyb.data();
      }
      const float wr = w[r];
      row_gemm_t(dyr, w2, I, H, a.data());  // a = dY W2^T  [I]
      float* dcr = dc + r * 2 * I;
      for (int64_t i = 0; i < I; ++i) {
        const float g_raw = bf16_to_float(fc1_c[r * 2 * I + i]);
        const float u_raw = bf16_to_float(fc1_c[r * 2 * I + I + i]);
        float g = g_raw, u = u_raw, gate_mask = 1.0f, up_mask = 1.0f;
        if (d.has_clamp) {
          gate_mask = g_raw <= lim ? 1.0f : 0.0f;
          up_mask = (u_raw >= -lim && u_raw <= lim) ? 1.0f : 0.0f;
          g = std::min(g_raw, lim);
          u = std::min(std::max(u_raw, -lim), lim);
        }
        const float sig = sigmoid(g);
        const float s = g * sig;
        h[i] = s * u;
        const float dh = a[i] * wr;
        float dg = dh * u * sig * (1.0f + g * (1.0f - sig));
        float du = dh * s;
        if (d.has_clamp) {
          dg = dg * gate_mask;
          du = du * up_mask;
        }
        dcr[i] = b16 ? round_bf16(dg) : dg;
        dcr[I + i] = b16 ? round_bf16(du) : du;
      }
      float* lhs = p_lhs + r * I;
      float* rhs = p_rhs + r * H;
      float dwr = 0.0f;
      if (b16) {  // dfc2 += R_bf16(w h)^T R_bf16(dY);  dw = sum(a * h), both placements
        for (int64_t i = 0; i < I; ++i) lhs[i] = round_bf16(wr * h[i]);
        std::copy(dyr, dyr + H, rhs);
        for (int64_t i = 0; i < I; ++i) dwr = dwr + a[i] * h[i];
      } else if (d.apply_topk_in_fc1) {  // dfc2 += (w h)^T dY;  dw = sum(a * h)
        for (int64_t i = 0; i < I; ++i) lhs[i] = wr * h[i];
        std::copy(dyr, dyr + H, rhs);
        for (int64_t i = 0; i < I; ++i) dwr = dwr + a[i] * h[i];
      } else {  // dfc2 += h^T (w dY);  dw = sum(dY * (h W2))
        std::copy(h.begin(), h.end(), lhs);
        for (int64_t j = 0; j < H; ++j) rhs[j] = wr * dyr[j];
        row_gemm(h.data(), w2, I, H, z.data());
        for (int64_t j = 0; j < H; ++j) dwr = dwr + dyr[j] * z[j];
      }
      dw[r] = dwr;
      row_gemm_t(dcr, w1, H, 2 * I, dx + r * H);  // dx = dc W1^T
    }
    if (!opt.accumulate) {
      std::fill(dfc1 + e * H * 2 * I, dfc1 + (e + 1) * H * 2 * I, 0.0f);
      std::fill(dfc2 + e * I * H, dfc2 + (e + 1) * I * H, 0.0f);
      slab_outer(x, dc, off[e], off[e + 1], H, 2 * I, dfc1 + e * H * 2 * I);
      slab_outer(p_lhs, p_rhs, off[e], off[e + 1], I, H, dfc2 + e * I * H);
    } else if (off[e + 1] > off[e]) {
      std::fill(g1.begin(), g1.end(), 0.0f);
      std::fill(g2.begin(), g2.end(), 0.0f);
      slab_outer(x, dc, off[e], off[e + 1], H, 2 * I, g1.data());
      slab_outer(p_lhs, p_rhs, off[e], off[e + 1], I, H, g2.data());
      float* o1 = dfc1 + e * H * 2 * I;
      float* o2 = dfc2 + e * I * H;
      for (int64_t j = 0; j < H * 2 * I; ++j) o1[j] = o1[j] + g1[j];
      for (int64_t j = 0; j < I * H; ++j) o2[j] = o2[j] + g2[j];
    }
  }
  for (int64_t r = off.back(); r < C; ++r) {  // rows of no expert: zero
    std::fill(dx + r * H, dx + (r + 1) * H, 0.0f);
    dw[r] = 0.0f;
  }
  return MOE_EP_OK;
}

}  // namespace cpu
}  // namespace moe_ep
