// The decode step as one program for DeepSeek-V2/V3/R1: MLA attention and DeepSeekMoE.
//
// Why: the Llama program (step_program.cpp) covers one layer shape; DeepSeek's decoder layer
// is another: MLA's projections and its absorbed decode over the latent cache, then a dense
// MLP (the first layers) or the router, the routed experts and the shared experts. Eager, a
// decode step calls ~40 operators a layer from Python, and the routed experts a loop of them.
// Here the same kernels and ATen operators run in the same order from one C++ call (the
// routed experts' sorting by expert and weighted sum run as host loops with the operators'
// arithmetic: ProgramMoE::routed_experts), so the program's hidden states equal the eager
// fused path's bit for bit
// (tests/models/test_step_program.py). The arithmetic of each piece is its Python's:
// models/deepseek_v2.py (MLA.forward), layers/attention/fused_cpu.py (the absorbed decode),
// layers/moe.py (route, RoutedExperts.forward, SharedExperts).
//
// Joined into one translation unit after cpu_ops.cpp and step_program.cpp (cpu_build.py):
// ProgramLinear, apply_linear, input_norm and gated come from the latter.

namespace {

// The reference's routing (layers/moe.py: route), operator for operator.
struct ProgramRouter {
  at::Tensor gate;                   // [E, hidden] fp32
  c10::optional<at::Tensor> bias;    // [E] fp32: V3's selection bias
  int64_t top_k = 1, n_group = 1, topk_group = 1;
  bool softmax = true, norm_topk = false;
  double scaling = 1.0;

  // x [T, hidden] → (weights [T, k] fp32, expert ids [T, k] int64).
  std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& x) const {
    const at::Tensor logits = at::linear(x.to(at::kFloat), gate);  // [T, E]
    const at::Tensor scores = softmax ? logits.softmax(-1) : logits.sigmoid();
    at::Tensor choice = bias.has_value() ? scores + *bias : scores;
    if (n_group > 1 && topk_group < n_group) {
      const int64_t t = choice.size(0);
      const at::Tensor grouped = choice.view({t, n_group, -1});  // [T, G, E/G]
      const at::Tensor group_scores = bias.has_value()
          ? std::get<0>(grouped.topk(2, -1)).sum(-1)  // V3: a group's two best experts
          : std::get<0>(grouped.max(-1));             // V2: its best one
      const at::Tensor keep = std::get<1>(at::topk(group_scores, topk_group, -1));
      const at::Tensor mask = at::ones_like(group_scores, group_scores.options().dtype(at::kBool)).scatter_(1, keep, false);
      choice = grouped.masked_fill(mask.unsqueeze(-1), -std::numeric_limits<double>::infinity()).view({t, -1});
    }
    const at::Tensor ids = std::get<1>(at::topk(choice, top_k, -1));
    at::Tensor weights = scores.gather(1, ids);
    if (norm_topk) weights = weights / (weights.sum(-1, /*keepdim=*/true) + 1e-20);
    return {weights * scaling, ids};
  }
};

// row += round(src · w), each product rounded to T before the addition, as a multiply and
// then a scatter-add operator compute it. No FMA contraction here (GCC contracts a float
// multiply feeding an addition at -O3): it would skip the product's rounding in fp32.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void weighted_add_row(T* row, const T* src, float w, int64_t n) {
  for (int64_t h = 0; h < n; ++h) {
    const T product = static_cast<T>(static_cast<float>(src[h]) * w);
    row[h] = static_cast<T>(static_cast<float>(row[h]) + static_cast<float>(product));
  }
}

struct ProgramMoE {
  ProgramRouter router;
  std::vector<ProgramLinear> w13, w2;  // per routed expert: [gate | up] and down
  std::vector<ProgramLinear> shared;   // the shared experts' gate|up and down (or none)

  // RoutedExperts.forward's arithmetic with its bookkeeping on the host: a decode step routes
  // a few rows, and the tensor operators that sort them by expert (argsort, bincount, a
  // gather, the weights reordered, a multiply, a scatter) cost ~5-10 µs each whatever their
  // size, more than a row's own weighting. The assignments are walked in the same order — by
  // expert, and within an expert by row — and each row is weighted and added as those
  // operators do it: y · w with w rounded to x's dtype first (RoutedExperts multiplies by
  // weights.to(dtype)), the product rounded, then added into the row (from zeros) and rounded,
  // one expert after another. x [T, hidden], weights [T, k] fp32, ids [T, k].
  at::Tensor routed_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids) const {
    const int64_t t = ids.size(0), k = ids.size(1), experts = static_cast<int64_t>(w13.size());
    const int64_t hidden = x.size(1);
    const at::Tensor ids_c = ids.contiguous(), w_c = weights.contiguous();
    const int64_t* idp = ids_c.const_data_ptr<int64_t>();
    const float* wp = w_c.const_data_ptr<float>();
    // Per expert, its assignments' rows and weights in flat order (row · k + slot): a stable
    // sort by expert, as RoutedExperts' argsort.
    std::vector<std::vector<int64_t>> rows(experts);
    std::vector<std::vector<float>> ws(experts);
    for (int64_t i = 0; i < t * k; ++i) {
      const int64_t e = idp[i];
      TORCH_CHECK(e >= 0 && e < experts, "step program: expert id ", e, " out of range");
      rows[e].push_back(i / k);
      ws[e].push_back(wp[i]);
    }
    at::Tensor out = at::zeros({t, hidden}, x.options());  // contiguous, whatever x's strides
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t n = static_cast<int64_t>(rows[e].size());
      if (n == 0) continue;
      const at::Tensor xs = n == 1 ? x.narrow(0, rows[e][0], 1).contiguous()
                                   : x.index_select(0, at::tensor(rows[e], ids.options()));
      const at::Tensor y = apply_linear(w2[e], gated(apply_linear(w13[e], xs))).contiguous();  // [n, hidden]
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "moe_weighted_add", [&] {
        using T = scalar_t;
        const T* yp = y.const_data_ptr<T>();
        T* op = out.data_ptr<T>();
        for (int64_t i = 0; i < n; ++i) {
          const float w = static_cast<float>(static_cast<T>(ws[e][i]));  // weights.to(dtype)
          weighted_add_row(op + rows[e][i] * hidden, yp + i * hidden, w, hidden);
        }
      });
    }
    return out;
  }

  // RoutedExperts.forward + SharedExperts: x [T, hidden] → [T, hidden].
  at::Tensor forward(const at::Tensor& x) const {
    at::Tensor weights, ids;
    {
      DSINFER_RANGE("dsinfer::moe_route");
      std::tie(weights, ids) = router.route(x);
    }
    at::Tensor routed;
    {
      DSINFER_RANGE("dsinfer::moe_routed_experts");
      routed = routed_experts(x, weights, ids);
    }
    if (shared.empty()) return routed;
    DSINFER_RANGE("dsinfer::moe_shared_experts");
    return routed + apply_linear(shared[1], gated(apply_linear(shared[0], x)));
  }
};

struct MlaProgramLayer {
  at::Tensor input_norm, post_norm, kv_a_norm;  // [hidden], [hidden], [lora]
  c10::optional<at::Tensor> q_a_norm;           // [q_lora] when q goes through a low rank
  at::Tensor cache;                             // [blocks, bs, lora + rope]: the latent pages
  at::Tensor kv_b;                              // kv_b_proj's weight [H·(nope + v), lora]
  std::vector<ProgramLinear> attn;              // q (or q_a, q_b), kv_a, o
  std::vector<ProgramLinear> mlp;               // a dense layer's gate|up, down
  c10::optional<ProgramMoE> moe;                // a routed layer's experts
};

}  // namespace

// Captured once per loaded DeepSeek model (weights, norms, latent pages, rotary tables bound);
// `run` replays a decode-only step for any number of rows, as DecodeProgram does.
struct MlaDecodeProgram : torch::CustomClassHolder {
  MlaDecodeProgram(at::Tensor cos, at::Tensor sin, at::Tensor final_norm, int64_t num_heads, int64_t nope,
                   int64_t rope, int64_t v_dim, int64_t lora, double scale, double eps)
      : cos_(std::move(cos)), sin_(std::move(sin)), final_norm_(std::move(final_norm)), heads_(num_heads),
        nope_(nope), rope_(rope), v_(v_dim), lora_(lora), scale_(scale), eps_(eps) {
    TORCH_CHECK(cos_.scalar_type() == at::kFloat && sin_.scalar_type() == at::kFloat,
                "step program: rotary tables must be fp32");
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor kv_a_norm,
                 c10::optional<at::Tensor> q_a_norm, at::Tensor cache, at::Tensor kv_b) {
    MlaProgramLayer layer;
    layer.input_norm = std::move(input_norm);
    layer.post_norm = std::move(post_norm);
    layer.kv_a_norm = std::move(kv_a_norm);
    layer.q_a_norm = std::move(q_a_norm);
    layer.cache = std::move(cache);
    layer.kv_b = std::move(kv_b);
    layers_.push_back(std::move(layer));
  }

  // Appends a projection of the last layer to `part`: "attn" (q or q_a, q_b; kv_a; o), "mlp"
  // (gate|up, down), "w13" / "w2" (routed expert e = the order of the calls), "shared".
  void add_linear(const std::string& part, int64_t kind, at::Tensor a, at::Tensor b,
                  c10::optional<at::Tensor> bias, int64_t dense_from_rows) {
    TORCH_CHECK(!layers_.empty(), "step program: add_layer first");
    TORCH_CHECK(kind >= kDense && kind <= kLastLinearKind, "step program: unknown kind ", kind);
    MlaProgramLayer& L = layers_.back();
    ProgramLinear lin{kind, std::move(a), std::move(b), std::move(bias), dense_from_rows};
    if (part == "attn") {
      L.attn.push_back(std::move(lin));
    } else if (part == "mlp") {
      L.mlp.push_back(std::move(lin));
    } else {
      TORCH_CHECK(L.moe.has_value(), "step program: set_router before the experts");
      if (part == "w13") L.moe->w13.push_back(std::move(lin));
      else if (part == "w2") L.moe->w2.push_back(std::move(lin));
      else if (part == "shared") L.moe->shared.push_back(std::move(lin));
      else TORCH_CHECK(false, "step program: unknown part ", part);
    }
  }

  // Makes the last layer a routed one (layers/moe.py: MoEConfig's routing fields).
  void set_router(at::Tensor gate, c10::optional<at::Tensor> bias, int64_t top_k, int64_t n_group,
                  int64_t topk_group, bool softmax, bool norm_topk, double scaling) {
    TORCH_CHECK(!layers_.empty(), "step program: add_layer first");
    TORCH_CHECK(gate.scalar_type() == at::kFloat && gate.dim() == 2, "step program: the router is fp32 [E, hidden]");
    ProgramMoE moe;
    moe.router = {std::move(gate), std::move(bias), top_k, n_group, topk_group, softmax, norm_topk, scaling};
    layers_.back().moe = std::move(moe);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [B, hidden] (embedded decode tokens), block_tables [B, NB] int64, seq_lens [B] int64
  // (tokens cached after this step) -> final-normed hidden states [B, hidden].
  at::Tensor run(at::Tensor x, at::Tensor block_tables, at::Tensor seq_lens) const {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "step program: contiguous [B, hidden] expected");
    TORCH_CHECK(!layers_.empty(), "step program: no layers");
    // Where this step's latent goes: the slot of position seq_len − 1 (the scheduler's
    // slot_blocks / slot_offsets for a decode-only step).
    const int64_t bs = layers_[0].cache.size(1);
    const at::Tensor pos = seq_lens - 1;
    const at::Tensor slot_blocks = block_tables.gather(1, at::div(pos, bs, "floor").unsqueeze(1)).squeeze(1).contiguous();
    const at::Tensor slot_offsets = pos.remainder(bs).contiguous();
    at::Tensor residual, h;
    for (size_t i = 0; i < layers_.size(); ++i) {
      DSINFER_RANGE("dsinfer::step_program_layer");
      const MlaProgramLayer& L = layers_[i];
      TORCH_CHECK(L.attn.size() == (L.q_a_norm.has_value() ? 4u : 3u), "step program: layer ", i, " is incomplete");
      h = input_norm(i, x, residual, L.input_norm, eps_);
      const at::Tensor o = attention(L, h, block_tables, seq_lens, slot_blocks, slot_offsets);
      {
        DSINFER_RANGE("dsinfer::add_rms_norm");
        std::tie(h, residual) = add_rms_norm(o, residual, L.post_norm, eps_);
      }
      if (L.moe.has_value()) {
        x = L.moe->forward(h);
      } else {
        TORCH_CHECK(L.mlp.size() == 2, "step program: layer ", i, " has no MLP");
        x = apply_linear(L.mlp[1], gated(apply_linear(L.mlp[0], h)));
      }
    }
    DSINFER_RANGE("dsinfer::add_rms_norm");
    return std::get<0>(add_rms_norm(x, residual, final_norm_, eps_));
  }

 private:
  // MLA.forward with the fused backend's decode-only path: h [B, hidden] → o_proj's [B, hidden].
  at::Tensor attention(const MlaProgramLayer& L, const at::Tensor& h, const at::Tensor& block_tables,
                       const at::Tensor& seq_lens, const at::Tensor& slot_blocks,
                       const at::Tensor& slot_offsets) const {
    const int64_t t = h.size(0);
    size_t next = 0;
    at::Tensor q;
    if (L.q_a_norm.has_value()) {
      const at::Tensor qa = apply_linear(L.attn[next++], h);
      at::Tensor normed;
      {
        DSINFER_RANGE("dsinfer::rms_norm");
        normed = rms_norm(qa, *L.q_a_norm, eps_);
      }
      q = apply_linear(L.attn[next++], normed);
    } else {
      q = apply_linear(L.attn[next++], h);
    }
    q = q.view({t, heads_, nope_ + rope_});
    const at::Tensor kv = apply_linear(L.attn[next++], h);  // [B, lora + rope]
    at::Tensor c;
    {
      DSINFER_RANGE("dsinfer::rms_norm");
      c = rms_norm(kv.narrow(1, 0, lora_).contiguous(), L.kv_a_norm, eps_);  // [B, lora]
    }
    at::Tensor q_pe, q_lat, o_lat, o;
    {
      DSINFER_RANGE("dsinfer::mla_rope_decode");
      q_pe = mla_rope_decode(q, kv, c, cos_, sin_, L.cache, slot_blocks, slot_offsets, seq_lens, nope_);
    }
    {
      DSINFER_RANGE("dsinfer::mla_absorb_query");
      q_lat = mla_absorb_query(q.narrow(2, 0, nope_).contiguous(), L.kv_b, v_);  // [B, H, lora]
    }
    {
      DSINFER_RANGE("dsinfer::mla_decode_attention");
      o_lat = mla_decode_attention(q_lat.contiguous(), q_pe.to(at::kFloat).contiguous(), L.cache, block_tables,
                                   seq_lens, scale_);
    }
    {
      DSINFER_RANGE("dsinfer::mla_expand_output");
      o = mla_expand_output(o_lat, L.kv_b, nope_).to(q.scalar_type());  // [B, H, v]
    }
    return apply_linear(L.attn[next], o.reshape({t, heads_ * v_}));
  }

  at::Tensor cos_, sin_, final_norm_;
  int64_t heads_, nope_, rope_, v_, lora_;
  double scale_, eps_;
  std::vector<MlaProgramLayer> layers_;
};

TORCH_LIBRARY_FRAGMENT(dsinfer, m) {
  m.class_<MlaDecodeProgram>("MlaDecodeProgram")
      .def(torch::init<at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, int64_t, int64_t, int64_t, double,
                       double>())
      .def("add_layer", &MlaDecodeProgram::add_layer)
      .def("add_linear", &MlaDecodeProgram::add_linear)
      .def("set_router", &MlaDecodeProgram::set_router)
      .def("num_layers", &MlaDecodeProgram::num_layers)
      .def("run", &MlaDecodeProgram::run);
}
