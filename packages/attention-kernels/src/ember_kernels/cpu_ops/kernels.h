// The compiled CPU kernels bound in bindings.cpp (arguments are checked by the Python wrappers in
// cpu_ops/__init__.py; the kernels check only what they rely on).
#pragma once

#include <torch/extension.h>

#include <optional>

void paged_attention(
    const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
    const torch::Tensor& block_table, const torch::Tensor& query_start_loc,
    const torch::Tensor& seq_lens, double scale, int64_t sliding_window, double soft_cap,
    torch::Tensor& out);

void rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, torch::Tensor& out);

void fused_add_rms_norm(
    const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& weight, double eps,
    torch::Tensor& out, torch::Tensor& residual_out);

void silu_and_mul(const torch::Tensor& x, torch::Tensor& out);

void rotary_embedding(
    const torch::Tensor& positions, const torch::Tensor& query,
    const std::optional<torch::Tensor>& key, const torch::Tensor& cos_sin_cache,
    bool is_neox_style, torch::Tensor& query_out, std::optional<torch::Tensor> key_out);

void reshape_and_cache(
    const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_cache,
    torch::Tensor& value_cache, const torch::Tensor& slot_mapping);
