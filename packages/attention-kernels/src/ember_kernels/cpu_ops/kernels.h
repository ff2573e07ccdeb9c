// The compiled CPU kernels bound in bindings.cpp (arguments are checked by the Python wrappers in
// cpu_ops/__init__.py; the kernels check only what they rely on).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

void paged_attention(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_table, const at::Tensor& query_start_loc,
    const at::Tensor& seq_lens, double scale, int64_t sliding_window, double soft_cap,
    at::Tensor& out);

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out);

void fused_add_rms_norm(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
    at::Tensor& out, at::Tensor& residual_out);

void silu_and_mul(const at::Tensor& x, at::Tensor& out);

void rotary_embedding(
    const at::Tensor& positions, const at::Tensor& query,
    const std::optional<at::Tensor>& key, const at::Tensor& cos_sin_cache,
    bool is_neox_style, at::Tensor& query_out, std::optional<at::Tensor> key_out);

void reshape_and_cache(
    const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
    at::Tensor& value_cache, const at::Tensor& slot_mapping);
