// Built-in manifests, generated in the order PyTorch's named_parameters() gives (Hugging Face names),
// with nn.Linear's weight layout [out_features, in_features].
#include "normuon/presets.h"

#include <cstdio>
#include <stdexcept>

namespace normuon {

namespace {

class Builder {
 public:
  explicit Builder(DType dtype) : dtype_(dtype) {}
  void add(std::string name, std::vector<int64_t> shape, Role role) {
    ParamSpec p;
    p.name = std::move(name);
    p.shape = std::move(shape);
    p.dtype = dtype_;
    p.role = role;
    m_.params.push_back(std::move(p));
  }
  // nn.Linear(in, out, bias): weight [out, in], then bias [out].
  void linear(const std::string& prefix, int64_t in, int64_t out, bool bias) {
    add(prefix + ".weight", {out, in}, Role::matrix);
    if (bias) add(prefix + ".bias", {out}, Role::bias);
  }
  void layer_norm(const std::string& prefix, int64_t d) {
    add(prefix + ".weight", {d}, Role::norm);
    add(prefix + ".bias", {d}, Role::bias);
  }
  Manifest take() { return std::move(m_); }

 private:
  DType dtype_;
  Manifest m_;
};

struct Gpt2Config {
  int64_t vocab, context, d_model, layers;
  bool tied;  // tied: wte doubles as the output head, so there is no lm_head entry
  DType dtype;
};

Manifest gpt2(const Gpt2Config& c) {
  const int64_t d = c.d_model;
  Builder b(c.dtype);
  b.add("transformer.wte.weight", {c.vocab, d}, Role::embedding);
  b.add("transformer.wpe.weight", {c.context, d}, Role::embedding);
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string h = "transformer.h." + std::to_string(i);
    b.layer_norm(h + ".ln_1", d);
    b.linear(h + ".attn.c_attn", d, 3 * d, true);
    b.linear(h + ".attn.c_proj", d, d, true);
    b.layer_norm(h + ".ln_2", d);
    b.linear(h + ".mlp.c_fc", d, 4 * d, true);
    b.linear(h + ".mlp.c_proj", 4 * d, d, true);
  }
  b.layer_norm("transformer.ln_f", d);
  if (!c.tied) b.add("lm_head.weight", {c.vocab, d}, Role::head);
  return b.take();
}

// Grouped-query attention without biases (Llama, Qwen): q and o are d x d, k and v are kv x d.
void gqa_attention(Builder& b, const std::string& layer, int64_t d, int64_t kv) {
  b.linear(layer + ".self_attn.q_proj", d, d, false);
  b.linear(layer + ".self_attn.k_proj", d, kv, false);
  b.linear(layer + ".self_attn.v_proj", d, kv, false);
  b.linear(layer + ".self_attn.o_proj", d, d, false);
}

// A SwiGLU MLP without biases: gate and up are ffn x d, down is d x ffn.
void swiglu(Builder& b, const std::string& prefix, int64_t d, int64_t ffn) {
  b.linear(prefix + ".gate_proj", d, ffn, false);
  b.linear(prefix + ".up_proj", d, ffn, false);
  b.linear(prefix + ".down_proj", ffn, d, false);
}

// A decoder layer's two RMSNorm weights.
void layer_rms_norms(Builder& b, const std::string& layer, int64_t d) {
  b.add(layer + ".input_layernorm.weight", {d}, Role::norm);
  b.add(layer + ".post_attention_layernorm.weight", {d}, Role::norm);
}

// Llama 3 layout: grouped-query attention, SwiGLU MLP, RMSNorm, no biases, tied embeddings.
struct LlamaConfig {
  int64_t vocab, d_model, layers, heads, kv_heads, ffn;
  DType dtype;
};

Manifest llama(const LlamaConfig& c) {
  const int64_t d = c.d_model;
  const int64_t kv = c.kv_heads * (d / c.heads);
  Builder b(c.dtype);
  b.add("model.embed_tokens.weight", {c.vocab, d}, Role::embedding);
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string l = "model.layers." + std::to_string(i);
    gqa_attention(b, l, d, kv);
    swiglu(b, l + ".mlp", d, c.ffn);
    layer_rms_norms(b, l, d);
  }
  b.add("model.norm.weight", {d}, Role::norm);
  return b.take();
}

// Fine-grained mixture of experts in the Qwen-MoE layout: every layer's MLP is `experts` small SwiGLU
// experts plus a router, so the model is thousands of small matrices (the launch-bound regime of a
// per-parameter optimizer), with grouped-query attention, RMSNorm, no biases and an untied head.
struct MoeConfig {
  int64_t vocab, d_model, layers, heads, kv_heads, experts, expert_ffn;
  DType dtype;
};

Manifest moe(const MoeConfig& c) {
  const int64_t d = c.d_model;
  const int64_t kv = c.kv_heads * (d / c.heads);
  Builder b(c.dtype);
  b.add("model.embed_tokens.weight", {c.vocab, d}, Role::embedding);
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string l = "model.layers." + std::to_string(i);
    gqa_attention(b, l, d, kv);
    b.linear(l + ".mlp.gate", d, c.experts, false);  // the router
    for (int64_t e = 0; e < c.experts; ++e) {
      swiglu(b, l + ".mlp.experts." + std::to_string(e), d, c.expert_ffn);
    }
    layer_rms_norms(b, l, d);
  }
  b.add("model.norm.weight", {d}, Role::norm);
  b.add("lm_head.weight", {c.vocab, d}, Role::head);
  return b.take();
}

struct Preset {
  const char* name;
  const char* summary;  // the description without the parameter count, which is computed
  Manifest (*build)();
};

const Preset kPresets[] = {
    {"tiny", "GPT-2 style, 4 layers, d_model 256, vocab 4096, untied head, f32 (the CPU default)",
     [] { return gpt2({4096, 256, 256, 4, false, DType::f32}); }},
    {"gpt2-124m", "GPT-2 small, 12 layers, d_model 768, tied embeddings, f32",
     [] { return gpt2({50257, 1024, 768, 12, true, DType::f32}); }},
    {"gpt-1.3b", "GPT-2 style, 24 layers, d_model 2048, context 2048, tied embeddings, bf16",
     [] { return gpt2({50257, 2048, 2048, 24, true, DType::bf16}); }},
    {"llama-1b", "Llama-3.2-1B-like, 16 layers, d_model 2048, GQA 32/8 heads, SwiGLU, tied embeddings, bf16",
     [] { return llama({128256, 2048, 16, 32, 8, 8192, DType::bf16}); }},
    {"moe-8x64", "Qwen-MoE-like, 8 layers x 64 experts x 3 matrices (d_model 1024, expert ffn 512), GQA 16/4 heads, "
                 "router, untied head, bf16",
     [] { return moe({32000, 1024, 8, 16, 4, 64, 512, DType::bf16}); }},
};

std::string format_count(int64_t n) {
  char buf[32];
  if (n >= 1000000000)
    std::snprintf(buf, sizeof buf, "%.2fB", static_cast<double>(n) / 1e9);
  else
    std::snprintf(buf, sizeof buf, "%.1fM", static_cast<double>(n) / 1e6);
  return buf;
}

}  // namespace

std::vector<PresetInfo> list_presets() {
  std::vector<PresetInfo> out;
  for (const Preset& p : kPresets)
    out.push_back({p.name, std::string(p.summary) + ", " + format_count(p.build().numel()) + " params"});
  return out;
}

Manifest preset_manifest(const std::string& name) {
  std::string known;
  for (const Preset& p : kPresets) {
    if (name == p.name) return p.build();
    known += (known.empty() ? "" : ", ") + std::string(p.name);
  }
  throw std::invalid_argument("unknown preset \"" + name + "\" (known: " + known + ")");
}

}  // namespace normuon
