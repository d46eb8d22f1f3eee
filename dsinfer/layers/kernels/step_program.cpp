// The decode step as one program: a Llama-family decoder stack run from C++ in one call.
//
// Why: with the kernels of cpu_ops.cpp the eager fused path spends more of a token in Python
// and the dispatcher (~10 op calls, their argument checks, tensor wrappers and views per
// layer, ~4 ms a token for SmolLM2's 30 layers) than in arithmetic. Here the step's sequence
// of kernels is fixed once (captured from the loaded model, tensors bound: weights in their
// kernel layouts, norms, KV-cache pages, rotary tables) and replayed by a C++ loop that calls
// the same kernels directly. Same kernels, same order, same rounding: the program's hidden
// states equal the eager fused path's bit for bit (tests/layers/test_step_program.py).
//
// This file is compiled in one translation unit after cpu_ops.cpp (cpu_build.py joins them),
// so it calls that file's kernels as plain functions.
#include <ATen/record_function.h>
#include <atomic>
#include <torch/custom_class.h>

namespace {

// A range torch.profiler sees (the program calls its kernels directly, not through the
// dispatcher): what ran stays countable, at the cost of a flag check when nobody profiles.
#define DSINFER_RANGE(name) RECORD_FUNCTION(name, std::vector<c10::IValue>())

// How a captured projection multiplies (the quantisation method of the layer says which).
enum ProgramLinearKind : int64_t {
  kDense = 0,
  kInt4Vnni = 1,
  kInt8 = 2,
  kInt8Vnni = 3,
  kInt8I16 = 4,
  kInt4I8 = 5,
  kInt8VnniI16 = 6,
  kLastLinearKind = kInt8VnniI16
};

struct ProgramLinear {
  int64_t kind = kDense;
  at::Tensor a;  // dense: weight [O, K]; int4: codes [O/16, K/8, 64]; int8: weight [O, K]
  at::Tensor b;  // int4: scales/zeros [O/16, G, 2, 16] bf16; int8: scales [O]
                 // (int8 VNNI: a is the packed weight [O/16, K/4, 64])
  c10::optional<at::Tensor> bias;
  int64_t dense_from_rows = 0;  // int4, int8 × int16: widen to bf16 for one GEMM from this many rows (0: never)
};

// Whether torch's own bf16 GEMM runs at the hardware's rate here (AVX512-BF16 or AMX):
// device.native_bf16_matmul's answer, which cpu_build.py sets once the library is loaded. A
// property of the CPU, not of this library's compile flags: a library built for another ISA
// (DSINFER_CPU_MARCH=haswell on an AVX-512 machine) still calls the torch of this CPU, and
// int8_mm (quant.py) asks the CPU.
std::atomic<bool> g_native_bf16_gemm{false};

void set_native_bf16_gemm(bool native) { g_native_bf16_gemm.store(native); }

// A repacked int8 weight widened to x's dtype for one dense GEMM, scaled after it (quant.py's
// int8_vnni_dense).
inline at::Tensor int8_vnni_dense(const ProgramLinear& l, const at::Tensor& x) {
  return at::mm(x, int8_vnni_dequantize_t(l.a).to(x.scalar_type())) * l.b;
}

// The rules of the Python methods (quant.py: Int4LinearMethod.apply with the VNNI layout,
// int8_mm with the fused kernels), row for row, so that a program and the eager path agree.
at::Tensor apply_linear(const ProgramLinear& l, const at::Tensor& x) {
  const int64_t rows = x.size(0);
  at::Tensor y;
  switch (l.kind) {
    case kDense:
      return at::linear(x, l.a, l.bias);  // F.linear: the bias inside the GEMM
    case kInt4Vnni:
    case kInt4I8:
      if (l.dense_from_rows > 0 && rows >= l.dense_from_rows && x.scalar_type() == at::kBFloat16) {
        at::Tensor wt;
        {
          DSINFER_RANGE("dsinfer::int4_vnni_dequantize_t");
          wt = int4_vnni_dequantize_t(l.a, l.b);
        }
        y = at::mm(x, wt);
      } else if (l.kind == kInt4I8) {  // --int8-activations
        DSINFER_RANGE("dsinfer::int4_i8_linear");
        y = int4_i8_linear(x, l.a, l.b);
      } else {
        DSINFER_RANGE("dsinfer::int4_bf16_linear");
        y = int4_bf16_linear(x, l.a, l.b);
      }
      break;
    case kInt8I16:
      if (rows <= 64) {  // quant.py's Int8LinearMethod.apply (AVX2), then int8_mm's rules
        DSINFER_RANGE("dsinfer::int8_i16_linear");
        y = int8_i16_linear(x, l.a, l.b, /*fp32_out=*/false);
        break;
      }
      [[fallthrough]];
    case kInt8: {
      const int64_t O = l.a.size(0), K = l.a.size(1);
      if (rows == 1 || (rows <= 64 && O >= 8192)) {  // quant.py's int8_mm, rule for rule
        DSINFER_RANGE("dsinfer::int8_linear");
        y = int8_linear(x, l.a, l.b);
      } else {
        // No native bf16 GEMM here (AVX2): never torch's emulated one.
        const bool emulated_bf16 = x.scalar_type() == at::kBFloat16 && !g_native_bf16_gemm.load();
        if (K % 16 == 0 && (rows < 16 || emulated_bf16))
          y = at::_weight_int8pack_mm(x, l.a, l.b.to(x.scalar_type()));
        else if (emulated_bf16)
          y = (at::mm(x.to(at::kFloat), l.a.to(at::kFloat).t()) * l.b.to(at::kFloat)).to(x.scalar_type());
        else
          y = at::mm(x, l.a.to(x.scalar_type()).t()) * l.b;
      }
      break;
    }
    case kInt8Vnni:
      if (rows <= 64) {
        DSINFER_RANGE("dsinfer::int8_vnni_linear");
        y = int8_vnni_linear(x, l.a, l.b, /*fp32_out=*/false);
      } else {
        y = int8_vnni_dense(l, x);
      }
      break;
    case kInt8VnniI16:  // quant.py's Int8LinearMethod.apply on a repacked narrow layer
      if (l.dense_from_rows == 0 || rows < l.dense_from_rows) {  // 0: never widened (AVX2)
        DSINFER_RANGE("dsinfer::int8_vnni_i16_linear");
        y = int8_vnni_i16_linear(x, l.a, l.b);
      } else {
        y = int8_vnni_dense(l, x);
      }
      break;
    default:
      TORCH_CHECK(false, "step program: unknown linear kind ", l.kind);
  }
  return l.bias.has_value() ? y + *l.bias : y;
}

// Decoder layer i's input norm: norm(x) with x as the residual for the first layer, else
// norm(x + residual) with the sum as the new residual (RMSNorm.forward's two cases).
inline at::Tensor input_norm(size_t i, const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                             double eps) {
  if (i == 0) {
    DSINFER_RANGE("dsinfer::rms_norm");
    residual = x;
    return rms_norm(x, weight, eps);
  }
  DSINFER_RANGE("dsinfer::add_rms_norm");
  at::Tensor h;
  std::tie(h, residual) = add_rms_norm(x, residual, weight, eps);
  return h;
}

// silu(gate) · up over [rows, 2I]: the fused kernel, as the eager path takes it (layers/kernels:
// FUSED_CPU.silu_and_mul on contiguous fp32/bf16 rows).
inline at::Tensor gated(const at::Tensor& gate_up) {
  DSINFER_RANGE("dsinfer::silu_mul");
  return silu_mul(gate_up);
}

struct ProgramLayer {
  at::Tensor input_norm, post_norm;  // [hidden]
  at::Tensor k_cache, v_cache;       // [blocks, KV, block_size, D]
  std::vector<ProgramLinear> linears;  // qkv, o, gate|up, down
};

}  // namespace

// Captured once per loaded model (bound to its weights and KV pages); `run` replays the
// decode step for any number of decode rows: kernel choice by rows happens inside, per call.
struct DecodeProgram : torch::CustomClassHolder {
  DecodeProgram(at::Tensor cos, at::Tensor sin, at::Tensor final_norm, int64_t num_heads,
                int64_t num_kv_heads, double scale, double eps)
      : cos_(std::move(cos)), sin_(std::move(sin)), final_norm_(std::move(final_norm)),
        heads_(num_heads), kv_heads_(num_kv_heads), scale_(scale), eps_(eps) {
    TORCH_CHECK(cos_.scalar_type() == at::kFloat && sin_.scalar_type() == at::kFloat,
                "step program: rotary tables must be fp32");
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor k_cache, at::Tensor v_cache) {
    layers_.push_back({std::move(input_norm), std::move(post_norm), std::move(k_cache), std::move(v_cache), {}});
  }

  // Appends a projection to the last layer, in the order qkv, o, gate|up, down.
  void add_linear(int64_t kind, at::Tensor a, at::Tensor b, c10::optional<at::Tensor> bias,
                  int64_t dense_from_rows) {
    TORCH_CHECK(!layers_.empty() && layers_.back().linears.size() < 4, "step program: add_layer first");
    TORCH_CHECK(kind >= kDense && kind <= kLastLinearKind, "step program: unknown kind ", kind);
    layers_.back().linears.push_back({kind, std::move(a), std::move(b), std::move(bias), dense_from_rows});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [B, hidden] (embedded decode tokens), block_tables [B, NB] int64, seq_lens [B] int64
  // (tokens cached after this step) -> final-normed hidden states [B, hidden].
  at::Tensor run(at::Tensor x, at::Tensor block_tables, at::Tensor seq_lens) const {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "step program: contiguous [B, hidden] expected");
    at::Tensor residual, h;
    for (size_t i = 0; i < layers_.size(); ++i) {
      DSINFER_RANGE("dsinfer::step_program_layer");
      const ProgramLayer& L = layers_[i];
      TORCH_CHECK(L.linears.size() == 4, "step program: layer ", i, " is incomplete");
      h = input_norm(i, x, residual, L.input_norm, eps_);
      const at::Tensor qkv = apply_linear(L.linears[0], h);  // [B, (H + 2KV) D]
      at::Tensor attn;
      {
        DSINFER_RANGE("dsinfer::rope_decode_attention");
        attn = rope_decode_attention(qkv, cos_, sin_, L.k_cache, L.v_cache, block_tables, seq_lens,
                                     heads_, kv_heads_, scale_);  // [B, H D]
      }
      const at::Tensor o = apply_linear(L.linears[1], attn);
      {
        DSINFER_RANGE("dsinfer::add_rms_norm");
        std::tie(h, residual) = add_rms_norm(o, residual, L.post_norm, eps_);
      }
      const at::Tensor gate_up = apply_linear(L.linears[2], h);  // [B, 2I]
      x = apply_linear(L.linears[3], gated(gate_up));          // [B, I] → [B, hidden]
    }
    DSINFER_RANGE("dsinfer::add_rms_norm");
    return std::get<0>(add_rms_norm(x, residual, final_norm_, eps_));
  }

 private:
  at::Tensor cos_, sin_, final_norm_;
  int64_t heads_, kv_heads_;
  double scale_, eps_;
  std::vector<ProgramLayer> layers_;
};

TORCH_LIBRARY_FRAGMENT(dsinfer, m) {
  m.def("set_native_bf16_gemm(bool native) -> ()", &set_native_bf16_gemm);
  m.class_<DecodeProgram>("DecodeProgram")
      .def(torch::init<at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, double, double>())
      .def("add_layer", &DecodeProgram::add_layer)
      .def("add_linear", &DecodeProgram::add_linear)
      .def("num_layers", &DecodeProgram::num_layers)
      .def("run", &DecodeProgram::run);
}
