// The decoder layers of a decode step (one new token per sequence) as a single op: per layer the
// same C++ ops in the same order as LlamaDecoderLayer.forward in pagedllm/models/llama.py, so
// the results are bitwise those of the Python path; what goes away is ~10 Python-level op and
// module calls per layer (about 5 ms of a 16 ms single-stream step on this machine,
// bench/README.md), and with them the Python loop over layers (~1 ms more, fifth round).
//
// A linear layer arrives as a tensor list whose first element's dtype says its kind (the
// attributes of pagedllm/layers/linear.py and quantization.py), with an optional trailing bias:
//   float / bfloat16: [weight_t [in, out]] (+ bias)        -> mm / addmm
//   packed (mkldnn):  [packed [out, in]] (+ bias)          -> mkldnn::_linear_pointwise
//   blocked bf16:     [blocked [N/32, K/2, 32, 2]] (+ bias) -> bf16_linear
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

at::Tensor linear(const at::Tensor& x, const std::vector<at::Tensor>& params) {
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

// Returns (sub-layer output not yet added to the residual stream, residual stream). residual is
// None for the first layer, whose input is the embedding (then that tensor becomes the stream).
std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& hidden, const std::optional<at::Tensor>& residual_in, const at::Tensor& input_norm,
    const at::Tensor& post_attention_norm, double eps, const std::vector<at::Tensor>& qkv_proj,
    const std::vector<at::Tensor>& o_proj, const std::vector<at::Tensor>& gate_up_proj,
    const std::vector<at::Tensor>& down_proj, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
    at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& context_lens) {
  const int64_t tokens = hidden.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor residual;
  at::Tensor x;
  if (residual_in.has_value()) {
    residual = *residual_in;
    x = add_rms_norm_(hidden, residual, input_norm, eps);
  } else {
    residual = hidden;
    x = rms_norm(hidden, input_norm, eps);
  }
  at::Tensor qkv = linear(x, qkv_proj);
  rotary_embedding_(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim);
  reshape_and_cache_(qkv.narrow(1, q_size, kv_size), qkv.narrow(1, q_size + kv_size, kv_size), key_cache,
                     value_cache, slot_mapping);
  const at::Tensor query = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
  const at::Tensor attn = paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale, 0);
  const at::Tensor attn_out = linear(attn.view({tokens, q_size}), o_proj);
  x = add_rms_norm_(attn_out, residual, post_attention_norm, eps);
  return {linear(silu_and_mul(linear(x, gate_up_proj)), down_proj), residual};
}

std::vector<at::Tensor> take(const std::vector<at::Tensor>& weights, size_t& next, int64_t count) {
  TORCH_CHECK_VALUE(count >= 0 && next + count <= weights.size(), "decode_layers: list_sizes exceed the weights");
  std::vector<at::Tensor> list(weights.begin() + next, weights.begin() + next + count);
  next += count;
  return list;
}

// Runs decode_layer for every layer. weights holds, layer after layer, the input and
// post-attention norm weights and then the qkv, o, gate_up and down linear lists, whose lengths
// are list_sizes[4 * layer + 0 .. 3]. Returns the last layer's (output, residual stream).
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden, const std::vector<at::Tensor>& weights, const std::vector<int64_t>& list_sizes,
    double eps, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double scale, const std::vector<at::Tensor>& key_caches,
    const std::vector<at::Tensor>& value_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& context_lens) {
  const size_t num_layers = key_caches.size();
  TORCH_CHECK_VALUE(value_caches.size() == num_layers && list_sizes.size() == 4 * num_layers,
                    "decode_layers: one K cache, one V cache and 4 list sizes per layer");
  at::Tensor x = hidden;
  std::optional<at::Tensor> residual;
  size_t next = 0;
  for (size_t layer = 0; layer < num_layers; ++layer) {
    const std::vector<at::Tensor> norms = take(weights, next, 2);
    const std::vector<at::Tensor> qkv = take(weights, next, list_sizes[4 * layer]);
    const std::vector<at::Tensor> o = take(weights, next, list_sizes[4 * layer + 1]);
    const std::vector<at::Tensor> gate_up = take(weights, next, list_sizes[4 * layer + 2]);
    const std::vector<at::Tensor> down = take(weights, next, list_sizes[4 * layer + 3]);
    at::Tensor key_cache = key_caches[layer], value_cache = value_caches[layer];
    std::tie(x, residual) = decode_layer(x, residual, norms[0], norms[1], eps, qkv, o, gate_up, down, positions, cos,
                                         sin, num_heads, num_kv_heads, head_dim, scale, key_cache, value_cache,
                                         slot_mapping, block_tables, context_lens);
  }
  TORCH_CHECK_VALUE(next == weights.size() && residual.has_value(), "decode_layers: weights left over, or no layers");
  return {x, *residual};
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("decode_layers(Tensor hidden, Tensor[] weights, int[] list_sizes, float eps, Tensor positions, "
        "Tensor cos, Tensor sin, int num_heads, int num_kv_heads, int head_dim, float scale, "
        "Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor slot_mapping, Tensor block_tables, "
        "Tensor context_lens) -> (Tensor, Tensor)",
        &pagedllm::decode_layers);
}
