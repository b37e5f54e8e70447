// The decoder layers of a decode step (one new token per sequence) as a single op: per layer the
// same C++ ops in the same order as LlamaDecoderLayer.forward in pagedllm/models/llama.py, so
// the results are bitwise those of the Python path; what goes away is ~10 Python-level op and
// module calls per layer (about 5 ms of a 16 ms single-stream step on this machine,
// bench/README.md), and with them the Python loop over layers (~1 ms more, fifth round).
// Two variations of the layer: per-head q/k RMSNorm before RoPE (Qwen3: LlamaAttention.norm_qk_)
// and a sparse MoE block in place of the MLP (SparseMoeBlock: route + fused_experts in
// pagedllm/layers/fused_moe.py, ~60 Python-level calls per layer at 8 experts a token).
//
// A linear layer arrives as a tensor list whose first element's dtype says its kind (the
// attributes of pagedllm/layers/linear.py and quantization.py), with an optional trailing bias:
//   float / bfloat16: [weight_t [in, out]] (+ bias)        -> mm / addmm
//   packed (mkldnn):  [packed [out, in]] (+ bias)          -> mkldnn::_linear_pointwise
//   blocked bf16:     [blocked [N/32, K/2, 32, 2]] (+ bias) -> bf16_linear
//   blocked fp32:     [blocked [N/32, K, 32]] (+ bias)       -> fp32_linear
//   int8:             [codes [N, K], scales] (+ bias)       -> int8_linear
//   uint8 (int4):     [packed [N, K/2], scales, mins] (+ bias) -> int4_linear
//   uint8 W8A8:       [blocked [N/16, K/4, 64], scales [N], smooth_inv [1, K]] (+ bias) -> w8a8_linear
//   uint8 W4A8:       [blocked [N/16, K/32, 320 or 576]] (+ bias) -> w4a8_linear
//                     (the two told apart by the last dimension)
// (the quantized kernels on fp32 rows, bf16 activations widened and the result narrowed back).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "ops.h"

namespace pagedllm {
namespace {

// params: a view into decode_layers' weights (no copies of the tensor handles per step).
at::Tensor linear(const at::Tensor& x, c10::ArrayRef<at::Tensor> params) {
  TORCH_CHECK_VALUE(!params.empty(), "decode_layer: a linear layer needs its weight");
  const at::Tensor& first = params[0];
  auto bias_at = [&](size_t index) -> std::optional<at::Tensor> {
    return params.size() > index ? std::optional<at::Tensor>(params[index]) : std::nullopt;
  };
  // The quantized kernels take fp32 rows and return fp32 (as _QuantizedLinear.forward: x.float(),
  // then the result in x's dtype), so bf16 compute runs them too.
  const bool widen = x.scalar_type() != at::kFloat;
  switch (first.scalar_type()) {
    case at::kChar: {
      const at::Tensor y = int8_linear(widen ? x.to(at::kFloat) : x.contiguous(), first, params.at(1), bias_at(2));
      return widen ? y.to(x.scalar_type()) : y;
    }
    case at::kByte: {
      if (first.dim() == 3 && first.size(2) == 64) {  // W8A8Linear.codes
        return w8a8_linear(x, first, params.at(1), params.at(2), bias_at(3), /*portable=*/false);
      }
      if (first.dim() == 3) return w4a8_linear(x, first, bias_at(1), /*portable=*/false);
      const at::Tensor y = int4_linear(widen ? x.to(at::kFloat) : x.contiguous(), first, params.at(1), params.at(2),
                                       bias_at(3));
      return widen ? y.to(x.scalar_type()) : y;
    }
    default:
      if (first.dim() == 4) return bf16_linear(x, first, bias_at(1), /*portable=*/false);  // Linear.blocked
      if (first.dim() == 3) return fp32_linear(x, first, bias_at(1));  // Linear.blocked, fp32
      if (first.is_mkldnn()) {  // Linear.packed: oneDNN's blocked layout (pagedllm/layers/linear.py)
        static const auto op = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                                   .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                                     const std::optional<at::Tensor>&, c10::string_view,
                                                     c10::List<std::optional<at::Scalar>>,
                                                     std::optional<c10::string_view>)>();
        return op.call(x, first, bias_at(1), "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
      }
      return params.size() > 1 ? at::addmm(params[1], x, first) : at::mm(x, first);
  }
}

// SparseMoeBlock.forward: the router's softmax in fp32, top_k, renormalized when normalize, then
// fused_experts: (token, expert) pairs sorted by expert (stable), each active expert's SwiGLU over
// its rows, the rows weighted and added back to their tokens in that order. lists[0] is the
// router, then each expert's gate_up and down.
at::Tensor sparse_moe(const at::Tensor& x, const std::vector<c10::ArrayRef<at::Tensor>>& lists, int64_t top_k,
                      bool normalize) {
  const int64_t num_experts = static_cast<int64_t>(lists.size() - 1) / 2;
  const at::Tensor probs = at::softmax(linear(x, lists[0]), -1, at::kFloat);
  auto [weights, expert_ids] = at::topk(probs, top_k, -1);
  if (normalize) weights = weights / weights.sum(-1, /*keepdim=*/true);
  const at::Tensor flat_ids = expert_ids.reshape(-1);
  const at::Tensor order = at::argsort(flat_ids, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const at::Tensor token_ids = at::floor_divide(order, top_k);
  const at::Tensor counts = at::bincount(flat_ids, {}, num_experts);
  const int64_t* count = counts.data_ptr<int64_t>();
  const at::Tensor rows = x.index_select(0, token_ids);
  at::Tensor out_rows = at::empty_like(rows);
  int64_t start = 0;
  for (int64_t expert = 0; expert < num_experts; ++expert) {
    if (count[expert] == 0) continue;
    const at::Tensor expert_rows = rows.narrow(0, start, count[expert]);
    out_rows.narrow(0, start, count[expert])
        .copy_(linear(silu_and_mul(linear(expert_rows, lists[1 + 2 * expert])), lists[2 + 2 * expert]));
    start += count[expert];
  }
  out_rows = out_rows * weights.reshape(-1).index_select(0, order).unsqueeze(1).to(x.scalar_type());
  return at::zeros_like(x).index_add_(0, token_ids, out_rows);
}

// Returns (sub-layer output not yet added to the residual stream, residual stream). residual is
// None for the first layer, whose input is the embedding (then that tensor becomes the stream).
// norms: input and post-attention norm weights, then the q and k norms' where the layer has them.
// mlp: gate_up and down (a dense MLP), or the router and each expert's two (sparse_moe).
std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& hidden, const std::optional<at::Tensor>& residual_in, c10::ArrayRef<at::Tensor> norms,
    double eps, c10::ArrayRef<at::Tensor> qkv_proj, c10::ArrayRef<at::Tensor> o_proj,
    const std::vector<c10::ArrayRef<at::Tensor>>& mlp, int64_t top_k, bool normalize_top_k,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double scale, at::Tensor& key_cache, at::Tensor& value_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& context_lens) {
  const int64_t tokens = hidden.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor residual;
  at::Tensor x;
  if (residual_in.has_value()) {
    residual = *residual_in;
    x = add_rms_norm_(hidden, residual, norms[0], eps);
  } else {
    residual = hidden;
    x = rms_norm(hidden, norms[0], eps);
  }
  at::Tensor qkv = linear(x, qkv_proj);
  if (norms.size() == 4) {  // per head, as LlamaAttention.norm_qk_
    at::Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size);
    q.copy_(rms_norm(q.reshape({-1, head_dim}), norms[2], eps).view({tokens, q_size}));
    k.copy_(rms_norm(k.reshape({-1, head_dim}), norms[3], eps).view({tokens, kv_size}));
  }
  rotary_embedding_(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim);
  reshape_and_cache_(qkv.narrow(1, q_size, kv_size), qkv.narrow(1, q_size + kv_size, kv_size), key_cache,
                     value_cache, slot_mapping);
  const at::Tensor query = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
  const at::Tensor attn = paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale, 0);
  const at::Tensor attn_out = linear(attn.view({tokens, q_size}), o_proj);
  x = add_rms_norm_(attn_out, residual, norms[1], eps);
  if (mlp.size() == 2) return {linear(silu_and_mul(linear(x, mlp[0])), mlp[1]), residual};
  return {sparse_moe(x, mlp, top_k, normalize_top_k), residual};
}

class Reader {
 public:
  Reader(const std::vector<at::Tensor>& weights, const std::vector<int64_t>& list_sizes)
      : weights_(weights), list_sizes_(list_sizes) {}

  int64_t size() {
    TORCH_CHECK_VALUE(next_size_ < list_sizes_.size(), "decode_layers: list_sizes ended early");
    return list_sizes_[next_size_++];
  }

  c10::ArrayRef<at::Tensor> list(int64_t count) {
    TORCH_CHECK_VALUE(count >= 0 && next_ + count <= weights_.size(), "decode_layers: list_sizes exceed the weights");
    const c10::ArrayRef<at::Tensor> list(weights_.data() + next_, count);
    next_ += count;
    return list;
  }

  bool done() const { return next_ == weights_.size() && next_size_ == list_sizes_.size(); }

 private:
  const std::vector<at::Tensor>& weights_;
  const std::vector<int64_t>& list_sizes_;
  size_t next_ = 0, next_size_ = 0;
};

// Runs decode_layer for every layer. weights holds, layer after layer, the layer's norm weights,
// then its qkv and o linear lists, then its MLP's lists; list_sizes holds per layer: the number
// of norms (2, or 4 with q/k norms), the qkv and o list lengths, the number of MLP lists (2 for
// a dense MLP, 1 + 2 * num_experts for a MoE block) and their lengths. top_k and
// normalize_top_k are the MoE blocks' routing. Returns the last layer's (output, residual).
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden, const std::vector<at::Tensor>& weights, const std::vector<int64_t>& list_sizes,
    double eps, int64_t top_k, bool normalize_top_k, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
    const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& context_lens) {
  const size_t num_layers = key_caches.size();
  TORCH_CHECK_VALUE(value_caches.size() == num_layers, "decode_layers: one K cache and one V cache per layer");
  at::Tensor x = hidden;
  std::optional<at::Tensor> residual;
  Reader reader(weights, list_sizes);
  for (size_t layer = 0; layer < num_layers; ++layer) {
    const int64_t num_norms = reader.size();
    TORCH_CHECK_VALUE(num_norms == 2 || num_norms == 4, "decode_layers: a layer has 2 or 4 norms, got ", num_norms);
    const c10::ArrayRef<at::Tensor> norms = reader.list(num_norms);
    const c10::ArrayRef<at::Tensor> qkv = reader.list(reader.size());
    const c10::ArrayRef<at::Tensor> o = reader.list(reader.size());
    const int64_t num_mlp_lists = reader.size();
    TORCH_CHECK_VALUE(num_mlp_lists == 2 || (num_mlp_lists >= 3 && num_mlp_lists % 2 == 1 && top_k > 0 &&
                                             top_k <= (num_mlp_lists - 1) / 2),
                      "decode_layers: an MLP has 2 lists, or a router and two per expert with top_k in [1, "
                      "num_experts]; got ", num_mlp_lists, " lists, top_k ", top_k);
    std::vector<c10::ArrayRef<at::Tensor>> mlp;
    mlp.reserve(num_mlp_lists);
    for (int64_t i = 0; i < num_mlp_lists; ++i) mlp.push_back(reader.list(reader.size()));
    at::Tensor key_cache = key_caches[layer], value_cache = value_caches[layer];
    std::tie(x, residual) = decode_layer(x, residual, norms, eps, qkv, o, mlp, top_k, normalize_top_k, positions,
                                         cos, sin, num_heads, num_kv_heads, head_dim, scale, key_cache, value_cache,
                                         slot_mapping, block_tables, context_lens);
  }
  TORCH_CHECK_VALUE(reader.done() && residual.has_value(), "decode_layers: weights left over, or no layers");
  return {x, *residual};
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("decode_layers(Tensor hidden, Tensor[] weights, int[] list_sizes, float eps, int top_k, "
        "bool normalize_top_k, Tensor positions, "
        "Tensor cos, Tensor sin, int num_heads, int num_kv_heads, int head_dim, float scale, "
        "Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor slot_mapping, Tensor block_tables, "
        "Tensor context_lens) -> (Tensor, Tensor)",
        &pagedllm::decode_layers);
}
