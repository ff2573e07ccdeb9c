// The compiled CPU kernels bound in bindings.cpp (arguments are checked by the Python wrappers in
// cpu_ops/__init__.py; the kernels check only what they rely on).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

void paged_attention(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_table, const at::Tensor& query_start_loc,
    const at::Tensor& seq_lens, double scale, int64_t sliding_window, double soft_cap,
    at::Tensor& out);

// The element-wise kernels allocate and return their outputs (contiguous).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps);

at::Tensor silu_and_mul(const at::Tensor& x);

std::tuple<at::Tensor, std::optional<at::Tensor>> rotary_embedding(
    const at::Tensor& positions, const at::Tensor& query, const std::optional<at::Tensor>& key,
    const at::Tensor& cos_sin_cache, bool is_neox_style);

void reshape_and_cache(
    const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
    at::Tensor& value_cache, const at::Tensor& slot_mapping);
