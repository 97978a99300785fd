// Tests for tensor parallelism in the graph stage (src/graph/tensor_parallel.{h,cpp} and the
// colwise / rowwise linears of the step builder), against what was measured with torch's
// parallelize_module on 2 gloo ranks for the narrow 4-layer Llama
// (data/ground_truth/configs/llama-3.2-1b-w512-l4.json: hidden 512, 8 heads, 4 KV heads,
// head_dim 64, intermediate 2,048, vocab 1,000, untied). The accuracy gate
// (tests/python/test_accuracy.py) holds whole estimates to the measurements; these pin the pieces.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "graph/step.h"
#include "graph/tensor_parallel.h"
#include "test_util.h"
#include "trainmem/trainmem.h"

namespace trainmem {
namespace {

using testing::allocs_at;
using testing::error_of;
using testing::kStates;
using testing::kWeights;
using testing::llama_w512;

// The measured recipe of cpu-tp2-llamaw512l4-fp32-sgd-b2s512.
Recipe tp_recipe(std::uint64_t tp) {
  Recipe r;
  r.batch = 2;
  r.seq = 512;
  r.precision = Precision::kFp32;
  r.optimizer = Optimizer::kSgd;
  r.gpu = "cpu";
  r.allocator = AllocatorMode::kExpandable;
  r.tp = tp;
  r.validate();
  return r;
}

std::uint64_t numel_of(const Model& m) {
  std::uint64_t n = 0;
  for (const ParameterGroup& g : m.parameters) n += g.numel * g.count;
  return n;
}

// Bytes of the storages first allocated in step 1, `phase`, decoder layer `layer`, under `op`.
std::vector<std::uint64_t> allocs(const graph::Trace& t, Phase phase, std::int32_t layer, std::string_view op) {
  std::vector<std::uint64_t> out;
  std::vector<bool> seen(t.storages.size(), false);
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& m = t.moments[e.moment];
    if (!e.alloc || seen[e.tensor] || m.step != 1 || m.phase != phase || m.layer != layer || m.op != op ||
        m.recompute) {
      continue;
    }
    seen[e.tensor] = true;
    out.push_back(t.storages[e.tensor].bytes);
  }
  return out;
}

TEST(TensorParallel, LocalModelHasTheShardedProjections) {
  const Model m = llama_w512();
  const Model local = graph::tensor_parallel_model(m, 2);
  EXPECT_EQ(local.arch.num_heads, 4u);
  EXPECT_EQ(local.arch.num_kv_heads, 2u);
  EXPECT_EQ(local.arch.intermediate_size, 1024u);
  EXPECT_EQ(local.arch.hidden_size, 512u);
  EXPECT_EQ(local.parameter_count, m.parameter_count);  // DTensors report the global numel
  // Measured: 35,571,712 B of fp32 parameters on each rank (plus the 1,024 B rotary buffer).
  EXPECT_EQ(numel_of(local) * 4, 35'571'712u);
  EXPECT_EQ(numel_of(m) * 4, 67'028'992u);
  EXPECT_EQ(graph::tensor_parallel_model(m, 1).parameters.size(), m.parameters.size());
}

TEST(TensorParallel, WeightsAtThePeakAreTheLocalShards) {
  const Estimate e = estimate(llama_w512(), tp_recipe(2));
  EXPECT_EQ(e.breakdown_at_peak[kWeights], 35'572'736u);
  EXPECT_EQ(e.parameters, llama_w512().parameter_count);
}

TEST(TensorParallel, RowwiseForwardAllReducesOutOfPlace) {
  // Measured, layer 0's forward: the local matmul's Partial output [1024, 512] and the all-reduce's
  // new tensor of the same size (then the partial one dies).
  const graph::Trace t = graph::build_training_trace(llama_w512(), tp_recipe(2), find_gpu("cpu"));
  const std::uint64_t out = 2 * 512 * 512 * 4;
  EXPECT_EQ(allocs(t, Phase::kForward, 0, "self_attn.o_proj"), (std::vector<std::uint64_t>{out, out}));
  EXPECT_EQ(allocs(t, Phase::kForward, 0, "mlp.down_proj"), (std::vector<std::uint64_t>{out, out}));
  // Colwise: only the local output, [1024, 256] for q, [1024, 1024] for gate.
  EXPECT_EQ(allocs(t, Phase::kForward, 0, "self_attn.q_proj"), (std::vector<std::uint64_t>{1024 * 256 * 4}));
  EXPECT_EQ(allocs(t, Phase::kForward, 0, "mlp.gate_proj"), (std::vector<std::uint64_t>{1024 * 1024 * 4}));
  // Without tensor parallelism o_proj makes its output only.
  const graph::Trace one = graph::build_training_trace(llama_w512(), tp_recipe(1), find_gpu("cpu"));
  EXPECT_EQ(allocs(one, Phase::kForward, 0, "self_attn.o_proj"), (std::vector<std::uint64_t>{out}));
}

TEST(TensorParallel, ColwiseBackwardAllReducesAndSumsInPlace) {
  // Measured, layer 3's backward at q_proj: the local weight's gradient [256, 512], then the
  // Partial input gradient [1024, 512] (mm's order, as on one process: Note [Gradient order of a
  // node] in tape.h) and the all-reduced input gradient. from_local's backward waits for the
  // collective, so that gradient is a plain tensor, added in place (`add_`) into k's and v's sum
  // (re-measured: the trace of cpu-tp2-qwen3w512l2-fp32-sgd-b2s256, every q/k and gate sum).
  const graph::Trace t = graph::build_training_trace(llama_w512(), tp_recipe(2), find_gpu("cpu"));
  const std::uint64_t x = 2 * 512 * 512 * 4;
  EXPECT_EQ(allocs(t, Phase::kBackward, 3, "self_attn.q_proj"), (std::vector<std::uint64_t>{256 * 512 * 4, x, x}));
  EXPECT_EQ(allocs(t, Phase::kBackward, 3, "mlp.gate_proj"), (std::vector<std::uint64_t>{1024 * 512 * 4, x, x}));
}

// Qwen2's q/k/v biases are ColwiseParallel's Shard(0) with their weights: each rank holds
// heads / tp of them (measured: parallel/cpu-tp2*-qwen25w512l2-*).
TEST(TensorParallel, Qwen2ShardsItsProjectionBiases) {
  const Model m = load_model("qwen2.5-0.5b");  // 14 heads, 2 KV heads of 64
  ASSERT_TRUE(m.arch.qkv_bias);
  const Model local = graph::tensor_parallel_model(m, 2);
  std::uint64_t q_bias = 0, k_bias = 0;
  for (const ParameterGroup& g : local.parameters) {
    if (g.name == "model.layers.N.self_attn.q_proj.bias") q_bias = g.numel;
    if (g.name == "model.layers.N.self_attn.k_proj.bias") k_bias = g.numel;
  }
  EXPECT_EQ(q_bias, 7u * 64);
  EXPECT_EQ(k_bias, 1u * 64);
  EXPECT_EQ(local.parameter_count, m.parameter_count);  // a DTensor's numel is the global one
}

// Qwen3's q_norm / k_norm normalise each head over head_dim: under the plan they run on the
// rank's heads, their weights stay whole (transformers' "replicated_with_grad_allreduce"; measured:
// parallel/cpu-tp2*-qwen3w512l2-*).
TEST(TensorParallel, Qwen3NormsTheLocalHeads) {
  const Model m = load_model("qwen3-0.6b");  // 16 heads, 8 KV heads of 128
  const Model local = graph::tensor_parallel_model(m, 2);
  for (const ParameterGroup& g : local.parameters) {
    if (g.name == "model.layers.N.self_attn.q_norm.weight" || g.name == "model.layers.N.self_attn.k_norm.weight") {
      EXPECT_EQ(g.numel, 128u) << g.name;
    }
  }
  Recipe r = tp_recipe(1);
  r.seq = 64;
  const graph::Trace one = graph::build_training_trace(m, r, find_gpu("cpu"));
  r.tp = 2;
  const graph::Trace two = graph::build_training_trace(m, r, find_gpu("cpu"));
  for (const char* op : {"self_attn.q_norm", "self_attn.k_norm"}) {
    std::vector<std::uint64_t> halves = allocs(one, Phase::kForward, 0, op);
    ASSERT_FALSE(halves.empty()) << op;
    for (std::uint64_t& b : halves) b /= 2;
    EXPECT_EQ(allocs(two, Phase::kForward, 0, op), halves) << op;
  }
}

TEST(TensorParallel, RefusesWhatIsNotModelled) {
  const Model m = llama_w512();
  EXPECT_NE(error_of([&] { graph::tensor_parallel_model(m, 3); })
                .find("num_attention_heads = 8 is not divisible by the tensor-parallel degree"),
            std::string::npos);
  EXPECT_NE(error_of([&] { graph::tensor_parallel_model(m, 8); }).find("num_key_value_heads = 4"), std::string::npos);
  EXPECT_NE(error_of([&] { graph::tensor_parallel_model(testing::gpt2_l2(), 2); }).find("c_attn"), std::string::npos);
  EXPECT_NE(error_of([&] { graph::tensor_parallel_model(load_model("phi-3-mini-4k-instruct"), 2); })
                .find("not modelled"),
            std::string::npos);
  // Gemma-2's feedforward norms are outside the sequence-parallel plan (torch fails there).
  EXPECT_NO_THROW(graph::tensor_parallel_model(load_model("gemma-2-2b"), 2));
  EXPECT_NE(error_of([&] { graph::tensor_parallel_model(load_model("gemma-2-2b"), 2, false, true); })
                .find("sequence_parallel: gemma2 is not modelled"),
            std::string::npos);
  Model o_biased = load_model("qwen2.5-0.5b");
  o_biased.arch.o_bias = true;  // a rowwise bias would be added to a Partial output
  EXPECT_NE(error_of([&] { graph::tensor_parallel_model(o_biased, 2); }).find("biases on o_proj"),
            std::string::npos);
  Recipe r = tp_recipe(1);
  r.tp = 2;
  r.gpus = 2;
  r.parallel = Parallel::kDdp;
  EXPECT_NE(error_of([&] { r.validate(); }).find("tensor parallelism combined with data parallelism"),
            std::string::npos);
  r = tp_recipe(2);
  r.lora.rank = 8;
  EXPECT_NE(error_of([&] { r.validate(); }).find("with LoRA or a 4-bit base"), std::string::npos);
  r = tp_recipe(2);
  r.precision = Precision::kBf16Mixed;
  EXPECT_NO_THROW(r.validate());  // measured, as under FSDP2 below
  r.gpus = 2;
  r.parallel = Parallel::kFsdp;
  EXPECT_NO_THROW(r.validate());
  r.precision = Precision::kFp16True;
  EXPECT_NE(error_of([&] { r.validate(); }).find("with precision fp16-true is not modelled"), std::string::npos);
  r = tp_recipe(2);
  r.tp = 65;
  EXPECT_NE(error_of([&] { r.validate(); }).find("tp"), std::string::npos);
  r = tp_recipe(2);
  r.mode = Mode::kInference;
  r.precision = Precision::kBf16True;
  EXPECT_NE(error_of([&] { r.validate(); }).find("training knob"), std::string::npos);
}

// Sequence parallelism (Note [Sequence parallelism]): the recipe of
// cpu-tp2sp-llamaw512l4-fp32-sgd-b2s64, whose trace (trainmem-measure --trace) the numbers below
// are read from: layer 1, step 1; a shard is [2, 32, 512] fp32 (131,072 B), the gathered or
// stacked tensor [2, 64, 512] / [4, 32, 512] (262,144 B).
Recipe sp_recipe() {
  Recipe r = tp_recipe(2);
  r.seq = 64;
  r.sequence_parallel = true;
  r.validate();
  return r;
}

TEST(SequenceParallel, ColwiseInputsAreGatheredEachOnItsOwn) {
  const graph::Trace t = graph::build_training_trace(llama_w512(), sp_recipe(), find_gpu("cpu"));
  const std::uint64_t full = 2 * 64 * 512 * 4;
  // q_proj: the stacked all_gather_into_tensor output, the gathered input (saved), the local output.
  EXPECT_EQ(allocs(t, Phase::kForward, 1, "self_attn.q_proj"), (std::vector<std::uint64_t>{full, full, 128 * 256 * 4}));
  EXPECT_EQ(allocs(t, Phase::kForward, 1, "self_attn.k_proj"), (std::vector<std::uint64_t>{full, full, 128 * 128 * 4}));
  // o_proj: the Partial local output, the chunks concatenated for reduce_scatter_tensor, the shard.
  EXPECT_EQ(allocs(t, Phase::kForward, 1, "self_attn.o_proj"), (std::vector<std::uint64_t>{full, full, full / 2}));
  EXPECT_EQ(allocs(t, Phase::kForward, 1, "mlp.down_proj"), (std::vector<std::uint64_t>{full, full, full / 2}));
  // The norms run on the shard: pow's output is [2, 32, 512].
  EXPECT_EQ(allocs(t, Phase::kForward, 1, "input_layernorm").front(), full / 2);
}

TEST(SequenceParallel, ColwiseBackwardReduceScattersAndSumsOutOfPlace) {
  const graph::Trace t = graph::build_training_trace(llama_w512(), sp_recipe(), find_gpu("cpu"));
  const std::uint64_t full = 2 * 64 * 512 * 4;
  // Measured at v_proj: the Partial input gradient and the weight's gradient (the measurement
  // makes the weight's first, as on one process), the concatenated chunks and the
  // reduce-scattered shard. k_proj adds the sum with v's shard gradient (a new tensor: a
  // DTensor's gradient is never accumulated in place).
  EXPECT_EQ(allocs(t, Phase::kBackward, 1, "self_attn.v_proj"),
            (std::vector<std::uint64_t>{full, 128 * 512 * 4, full, full / 2}));
  EXPECT_EQ(allocs(t, Phase::kBackward, 1, "self_attn.k_proj"),
            (std::vector<std::uint64_t>{full, 128 * 512 * 4, full, full / 2, full / 2}));
}

// Note [Gathering a batch of one]: with batch 1 an all-gather on the sequence is a view of the
// stacked buffer. The numbers: b1 s128, the same shard and gathered sizes as sp_recipe(); the
// orders are cpu-tp2sp-llamaw512l4-fp32-sgd-b1s1024's (trainmem-measure --trace), scaled.
TEST(SequenceParallel, BatchOneGathersAreViewsOfTheStackedBuffer) {
  Recipe r = sp_recipe();
  r.batch = 1;
  r.seq = 128;
  r.validate();
  const graph::Trace t = graph::build_training_trace(llama_w512(), r, find_gpu("cpu"));
  const std::uint64_t full = 1 * 128 * 512 * 4;
  // q_proj: the stacked output, saved as the gathered input; the local output. No cat.
  EXPECT_EQ(allocs(t, Phase::kForward, 1, "self_attn.q_proj"), (std::vector<std::uint64_t>{full, 128 * 256 * 4}));
  // The reduce-scatter after o_proj still concatenates its chunks.
  EXPECT_EQ(allocs(t, Phase::kForward, 1, "self_attn.o_proj"), (std::vector<std::uint64_t>{full, full, full / 2}));
  // down_proj's backward: the output gradient all-gathered (the stacked output is the gradient,
  // no cat), then the local matmul's weight gradient [512, 1024] and input gradient [128, 1024].
  EXPECT_EQ(allocs(t, Phase::kBackward, 1, "mlp.down_proj"),
            (std::vector<std::uint64_t>{full, 512 * 1024 * 4, 128 * 1024 * 4}));
}

TEST(SequenceParallel, RefusesAnUnevenSequenceAndNoTensorParallelism) {
  Recipe r = sp_recipe();
  r.seq = 63;
  EXPECT_NE(error_of([&] { r.validate(); }).find("seq 63 is not a multiple of tp: 2"), std::string::npos);
  r = tp_recipe(1);
  r.sequence_parallel = true;
  EXPECT_NE(error_of([&] { r.validate(); }).find("sequence_parallel: needs tensor parallelism"), std::string::npos);
}

// Loss parallelism (Note [Loss parallel]): the recipe of cpu-tp2lp-llamaw512l4-fp32-sgd-b2s512 and,
// for the op-by-op numbers, `trainmem-measure ... --tp 2 --loss-parallel --batch 2 --seq 64
// --precision fp32 --optimizer sgd --trace` (step 1): a rank's logits are [128, 500] fp32.
Recipe lp_recipe(std::uint64_t seq, bool sp = false) {
  Recipe r = tp_recipe(2);
  r.seq = seq;
  r.sequence_parallel = sp;
  r.loss_parallel = true;
  r.validate();
  return r;
}

// Every storage first allocated in step 1 outside the decoder layers in `phase` under one of `ops`.
std::vector<std::uint64_t> head_allocs(const graph::Trace& t, Phase phase, std::vector<std::string_view> ops) {
  std::vector<std::uint64_t> out;
  for (std::string_view op : ops) {
    for (std::uint64_t b : allocs(t, phase, -1, op)) out.push_back(b);
  }
  return out;
}

TEST(LossParallel, LmHeadWeightIsTheVocabShard) {
  const Model m = llama_w512();
  const Model local = graph::tensor_parallel_model(m, 2, /*loss_parallel=*/true);
  // Measured: 34,547,712 B of fp32 parameters on each rank, lm_head's 1,000 x 512 halved.
  EXPECT_EQ(numel_of(local) * 4, 34'547'712u);
  EXPECT_EQ(numel_of(graph::tensor_parallel_model(m, 2)) * 4 - numel_of(local) * 4, 500u * 512 * 4);
  const Estimate e = estimate(m, lp_recipe(512));
  EXPECT_EQ(e.breakdown_at_peak[kWeights], 34'548'736u);  // measured, with the rotary buffer
}

TEST(LossParallel, LocalLogitsAndOneLogitsGradient) {
  const graph::Trace t = graph::build_training_trace(llama_w512(), lp_recipe(64), find_gpu("cpu"));
  const std::uint64_t logits = 128 * 500 * 4;
  // Forward: lm_head's local output only.
  EXPECT_EQ(allocs(t, Phase::kForward, -1, "lm_head"), (std::vector<std::uint64_t>{logits}));
  const std::uint64_t n = 128;  // tokens
  // Loss (measured event by event, the handlers under the tracker's mode): padded labels
  // [2, 65], shifted [2, 64]; _log_softmax's handler: amax, its all-reduce, the shifted logits,
  // exp, sum, its all-reduce, log, the result; nll_loss_forward's handler: ne, the safe targets,
  // lt, ge, the mask, clone, sub, a lifted 0, gather, a lifted 0.0, the all-reduce, neg, ne,
  // where, ne, the count, total_weight, sum, the mean; then the division by grad_accum.
  EXPECT_EQ(head_allocs(t, Phase::kLoss, {"loss"}),
            (std::vector<std::uint64_t>{2 * 65 * 8, 2 * 64 * 8,
                                        n * 4, n * 4, logits, logits, n * 4, n * 4, n * 4, logits,
                                        n, n * 8, n, n, n, n * 8, n * 8, 8, n * 4, 4, n * 4,
                                        n * 4, n, n * 4, n, 8, 4, 4, 4, 4}));
  // Backward (measured): the seed and its division; nll_loss_backward's handler: the scaled
  // grad_output, ne, the safe targets, zeros_like(x), the partition (lt, ge, mask, clone, sub,
  // a lifted 0), the mask as fp32 and minus 1, arange, ne, the masked grad_output, exp(x), the
  // sum and the product: ONE local logits gradient (a plain cross-entropy makes two). Then
  // lm_head's local weight gradient, its Partial input gradient, the all-reduced one.
  EXPECT_EQ(head_allocs(t, Phase::kBackward, {"loss"}),
            (std::vector<std::uint64_t>{4, 4, 4, n, n * 8, logits, n, n, n, n * 8, n * 8, 8, n * 4, n * 4,
                                        n * 8, n, n * 4, logits, logits, logits}));
  // The partition's t.clone() - start: the clone is the subtraction's operand and dies after
  // its result is made (measured, loss and backward alike), right after the mask's comparisons.
  for (Phase phase : {Phase::kLoss, Phase::kBackward}) {
    std::vector<std::pair<bool, std::uint64_t>> events;
    for (const graph::Event& e : t.events) {
      const graph::MomentTag& m = t.moments[e.moment];
      if (m.step == 1 && m.phase == phase && m.op == "loss") events.emplace_back(e.alloc, t.storages[e.tensor].bytes);
    }
    const std::vector<std::pair<bool, std::uint64_t>> partition = {
        {true, n}, {false, n}, {false, n}, {true, n * 8}, {true, n * 8}, {false, n * 8}};
    EXPECT_NE(std::search(events.begin(), events.end(), partition.begin(), partition.end()), events.end())
        << static_cast<int>(phase);
  }
  std::vector<std::uint64_t> head = head_allocs(t, Phase::kBackward, {"lm_head"});
  std::sort(head.begin(), head.end());
  EXPECT_EQ(head, (std::vector<std::uint64_t>{128 * 512 * 4, 128 * 512 * 4, 500 * 512 * 4}));
  // Without loss_parallel the logits are whole and the cross-entropy backward makes two gradients.
  Recipe plain = lp_recipe(64);
  plain.loss_parallel = false;
  const graph::Trace p = graph::build_training_trace(llama_w512(), plain, find_gpu("cpu"));
  EXPECT_EQ(allocs(p, Phase::kForward, -1, "lm_head"), (std::vector<std::uint64_t>{2 * logits}));
}

TEST(LossParallel, SequenceParallelGathersTheHeadInput) {
  // Under sequence parallelism lm_head's input is all-gathered (stacked, then concatenated) and
  // its Partial gradient reduce-scattered back to the shard, as for any colwise projection.
  const graph::Trace t = graph::build_training_trace(llama_w512(), lp_recipe(64, true), find_gpu("cpu"));
  const std::uint64_t full = 2 * 64 * 512 * 4;
  EXPECT_EQ(allocs(t, Phase::kForward, -1, "lm_head"), (std::vector<std::uint64_t>{full, full, 128 * 500 * 4}));
}

TEST(LossParallel, RefusesWhatIsNotModelled) {
  Recipe r = tp_recipe(1);
  r.loss_parallel = true;
  EXPECT_NE(error_of([&] { r.validate(); }).find("loss_parallel: needs tensor parallelism"), std::string::npos);
  r = lp_recipe(64);
  r.loss = Loss::kFused;
  EXPECT_NE(error_of([&] { r.validate(); }).find("loss fused is not modelled"), std::string::npos);
  // Tied embeddings: Llama-3.2-1B ties lm_head to the embedding.
  const Model tied = load_model("llama-3.2-1b");
  ASSERT_TRUE(tied.arch.tie_word_embeddings);
  EXPECT_NE(error_of([&] { graph::tensor_parallel_model(tied, 2, true); }).find("tied embeddings"), std::string::npos);
  EXPECT_NO_THROW(graph::tensor_parallel_model(tied, 2, false));
  // An odd vocabulary cannot be split in two equal shards.
  Model odd = llama_w512();
  odd.arch.vocab_size = 1001;
  odd.parameters = graph::tensor_parallel_model(odd, 1).parameters;
  EXPECT_NE(error_of([&] { graph::tensor_parallel_model(odd, 2, true); }).find("vocab_size = 1001 is not divisible"),
            std::string::npos);
}

// TP x DP (docs/parallelism.md "TP x DP"): FSDP2 over the dp dimension of a (dp, tp) mesh, the
// recipe of cpu-tp2dp2-llamaw512l4-fp32-sgd-b1s64 (4 gloo ranks, tp 2, gpus (dp) 2).
Recipe tpdp_recipe() {
  Recipe r = tp_recipe(2);
  r.batch = 1;
  r.seq = 64;
  r.allocator = AllocatorMode::kDefault;
  r.gpus = 2;
  r.parallel = Parallel::kFsdp;
  r.validate();
  return r;
}

TEST(TensorXDataParallel, ShardsAreTheTpLocalParametersOverDp) {
  // fully_shard over mesh["dp"] splits dim 0 of each rank's TP-local tensor (_fsdp_param.py,
  // _init_sharding_spec_tp returns the DTensor's _local_tensor): every local dim 0 of this model
  // is even, so the shards are exactly the TP-local parameters / dp. Measured: 17,785,856 B of
  // SGD momentum (one per shard) on every rank.
  const Model m = llama_w512();
  const graph::Trace t = graph::build_training_trace(m, tpdp_recipe(), find_gpu("cpu"));
  std::uint64_t sharded = 0;
  for (std::uint64_t b : allocs_at(t, "fsdp.fully_shard")) sharded += b;
  EXPECT_EQ(sharded, numel_of(graph::tensor_parallel_model(m, 2)) * 4 / 2);
  EXPECT_EQ(sharded, 17'785'856u);
  // A layer's all-gather is dp x its shard: the whole TP-local layer (measured: 7,868,416 B).
  const std::vector<std::uint64_t> flats = allocs_at(t, "fsdp.all_gather");
  ASSERT_GE(flats.size(), 2u);
  EXPECT_EQ(flats[1], 7'868'416u);
  const Estimate e = estimate(m, tpdp_recipe());
  EXPECT_EQ(e.breakdown_at_peak[kStates], 17'785'856u);
}

TEST(TensorXDataParallel, ReplicatedNormSumsItsOwnGradientsOutOfPlace) {
  // Measured (the trace of cpu-tp2dp2-llamaw512l4-fp32-sgd-b1s64, layer 1's input_layernorm in
  // step 1's backward): the norm is a Replicate DTensor module, so the sum of its input's two
  // gradients (through pow and through the normalising mul) is a new tensor; from_local's
  // backward then hands that sum's local tensor on, a plain tensor added in place (`add_`) into
  // the residual's gradient. A [1, 64, 512] fp32 tensor is 131,072 B.
  const std::uint64_t x = 64 * 512 * 4;
  const std::vector<std::uint64_t> want = {x, x, 2048, x, x, 256, 256, 256, 256, x, x, x, x, x};
  const graph::Trace t = graph::build_training_trace(llama_w512(), tpdp_recipe(), find_gpu("cpu"));
  EXPECT_EQ(allocs(t, Phase::kBackward, 1, "input_layernorm"), want);
  // Without tensor parallelism the norm's own sum is in place too: one tensor fewer.
  Recipe one = tpdp_recipe();
  one.tp = 1;
  one.validate();
  const graph::Trace u = graph::build_training_trace(llama_w512(), one, find_gpu("cpu"));
  EXPECT_EQ(allocs(u, Phase::kBackward, 1, "input_layernorm").size(), want.size() - 1);
}

TEST(TensorXDataParallel, Qwen3HeadNormGradientsAreAllReducedInThePostBackward) {
  // q_norm's and k_norm's weights are Replicate on the tp mesh with Partial gradients (their input
  // is a head Shard), so FSDP2's post-backward all-reduces each, [head_dim] fp32, once per layer
  // and step (measured: cpu-tp2dp2-qwen3w512l2-fp32-adamw-b1s64 traced, every rank). Without
  // head norms (Llama) nothing is redistributed.
  const Model m = testing::measured_config("qwen3-0.6b-w512-l2");
  const graph::Trace t = graph::build_training_trace(m, tpdp_recipe(), find_gpu("cpu"));
  const std::vector<std::uint64_t> want(2 * 2 * 2, 64 * 4);  // 2 norms x 2 layers x 2 steps
  EXPECT_EQ(allocs_at(t, "fsdp.redistribute_grad"), want);
  const graph::Trace llama = graph::build_training_trace(llama_w512(), tpdp_recipe(), find_gpu("cpu"));
  EXPECT_TRUE(allocs_at(llama, "fsdp.redistribute_grad").empty());
}

// The events (alloc or free, bytes) of step 1's backward from the first `from` moment on.
std::vector<std::pair<bool, std::uint64_t>> backward_events_from(const graph::Trace& t, std::string_view from,
                                                                 std::size_t n) {
  std::vector<std::pair<bool, std::uint64_t>> out;
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& m = t.moments[e.moment];
    if (m.step != 1 || m.phase != Phase::kBackward || (out.empty() && m.op != from)) continue;
    if (out.size() == n) break;
    out.emplace_back(e.alloc, t.storages[e.tensor].bytes);
  }
  return out;
}

TEST(TensorParallel, OneLocalKeyValueHeadReshapesItsGradientAsAView) {
  // proj(x).view(b, s, heads, d).transpose(1, 2): the rotary embedding's backward makes q's and
  // k's gradients laid out [b, heads, s, d], and reshaping them back copies them, unless a rank
  // holds one head, where both layouts are the same (measured: a 2-KV-head Llama on 2 ranks,
  // tests/python/test_measure_parallel.py). Here 4 KV heads: 2 per rank at tp 2, 1 at tp 4.
  Recipe r = tp_recipe(2);
  const graph::Trace two = graph::build_training_trace(llama_w512(), r, find_gpu("cpu"));
  const std::uint64_t tok = 2 * 512, d = 64;
  EXPECT_EQ(allocs(two, Phase::kBackward, 3, "self_attn.clone"), (std::vector<std::uint64_t>{tok * 2 * d * 4, tok * 4 * d * 4}));
  r.tp = 4;
  r.validate();
  const graph::Trace four = graph::build_training_trace(llama_w512(), r, find_gpu("cpu"));
  EXPECT_EQ(allocs(four, Phase::kBackward, 3, "self_attn.clone"), (std::vector<std::uint64_t>{tok * 2 * d * 4}));
}

TEST(TensorParallel, OneLocalKeyValueHeadIsRepeatedAsAView) {
  // Eager attention on a rank with one KV head of four query heads' worth (tp 4): repeat_kv is a
  // view (expand, then a reshape that merges a dimension of size 1), so K and V are copied by
  // matmul's fold, at their matmuls, and not by repeat_kv ahead of both (measured: a 2-KV-head
  // Llama on 2 ranks, eager, b = 2, fp32 and bf16-mixed, every allocation).
  Recipe r = tp_recipe(2);
  r.attention = Attention::kEager;
  r.validate();
  const std::uint64_t tok = 2 * 512, d = 64, scores = 2 * 512 * 512 * 4;
  const graph::Trace two = graph::build_training_trace(llama_w512(), r, find_gpu("cpu"));
  // tp 2: 4 query heads, 2 KV heads: repeat_kv copies K and V, then q's fold, then the scores.
  const std::vector<std::uint64_t> repeated = allocs(two, Phase::kForward, 0, "self_attn.attn_weights");
  ASSERT_GE(repeated.size(), 4u);
  EXPECT_EQ(std::vector<std::uint64_t>(repeated.begin(), repeated.begin() + 4),
            (std::vector<std::uint64_t>{tok * 4 * d * 4, tok * 4 * d * 4, tok * 4 * d * 4, 4 * scores}));
  r.tp = 4;
  r.validate();
  const graph::Trace four = graph::build_training_trace(llama_w512(), r, find_gpu("cpu"));
  const std::vector<std::uint64_t> weights = allocs(four, Phase::kForward, 0, "self_attn.attn_weights");
  // tp 4: 2 query heads, 1 KV head: q's fold and K's fold (at the repeated size), then the scores.
  ASSERT_GE(weights.size(), 3u);
  EXPECT_EQ(std::vector<std::uint64_t>(weights.begin(), weights.begin() + 3),
            (std::vector<std::uint64_t>{tok * 2 * d * 4, tok * 2 * d * 4, 2 * scores}));
  // V's fold copy comes at the second matmul.
  const std::vector<std::uint64_t> output = allocs(four, Phase::kForward, 0, "self_attn.attn_output");
  ASSERT_FALSE(output.empty());
  EXPECT_EQ(output.front(), tok * 2 * d * 4);
}

TEST(TensorParallel, Qwen3HeadNormsAreDTensorModulesUnderSequenceParallelismToo) {
  // q_norm and k_norm take their input as a head Shard DTensor (from_local) with or without
  // sequence parallelism, so their two input gradients are summed out of place in both
  // (measured: cpu-tp2sp-qwen3w512l2-fp32-adamw-b2s128 and cpu-tp2-qwen3w512l2-fp32-sgd-b2s256,
  // every allocation): the same allocations, where sequence parallelism changes only the norms
  // of the residual stream.
  const Model m = load_model("qwen3-0.6b");
  Recipe r = tp_recipe(2);
  r.seq = 128;
  r.validate();
  const graph::Trace plain = graph::build_training_trace(m, r, find_gpu("cpu"));
  r.sequence_parallel = true;
  r.validate();
  const graph::Trace sp = graph::build_training_trace(m, r, find_gpu("cpu"));
  for (const char* op : {"self_attn.q_norm", "self_attn.k_norm"}) {
    const std::vector<std::uint64_t> want = allocs(plain, Phase::kBackward, 1, op);
    ASSERT_FALSE(want.empty()) << op;
    EXPECT_EQ(allocs(sp, Phase::kBackward, 1, op), want) << op;
  }
}

TEST(TensorParallel, OneLocalHeadFoldsAndTransposesAsViews) {
  // Two heads on two ranks: one query and one KV head each, for which [b, heads, s, d] and
  // [b, s, heads, d] are the same memory. Eager attention copies nothing for matmul's folds or for
  // transpose(1, 2).contiguous(): the scores, their scaling and the mask's sum, then bmm's output
  // alone (measured: tools/trace_allocs.py on 2 ranks, eager and SDPA, every allocation).
  const Model m = model_from_config_json(
      R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 256,
          "max_position_embeddings": 64, "tie_word_embeddings": false})");
  Recipe r = tp_recipe(2);
  r.seq = 16;
  r.allocator = AllocatorMode::kDefault;
  r.attention = Attention::kEager;
  r.validate();
  const graph::Trace t = graph::build_training_trace(m, r, find_gpu("cpu"));
  const std::uint64_t scores = 2 * 16 * 16 * 4, out = 2 * 16 * 32 * 4;
  EXPECT_EQ(allocs(t, Phase::kForward, 0, "self_attn.attn_weights"), (std::vector<std::uint64_t>{scores, scores, scores}));
  EXPECT_EQ(allocs(t, Phase::kForward, 0, "self_attn.attn_output"), (std::vector<std::uint64_t>{out}));
}

TEST(TensorParallel, CheckpointInputGoesBeforeTheReplicatedNormsSum) {
  // Measured (the trace of cpu-tp2-llamaw512l4-fp32-sgd-ckpt-b2s256, the end of layer 3's
  // backward in step 1): the checkpoint's frame, which holds the layer's input, goes when the
  // segment's first saving node (input_layernorm's pow, whose saved input is that same fp32
  // tensor) releases its variables, before the engine sums the norm's two input gradients
  // (a DTensor sum, a new tensor) and adds that into the residual's gradient in place.
  Recipe r = tp_recipe(2);
  r.seq = 256;
  r.allocator = AllocatorMode::kDefault;
  r.checkpointing = Checkpointing::kFull;
  r.validate();
  const graph::Trace t = graph::build_training_trace(llama_w512(), r, find_gpu("cpu"));
  const std::uint64_t x = 2 * 256 * 512 * 4;
  std::vector<std::pair<bool, std::uint64_t>> tail;
  for (const graph::Event& e : t.events) {
    const graph::MomentTag& m = t.moments[e.moment];
    if (m.step == 1 && m.phase == Phase::kBackward && m.layer == 3) tail.emplace_back(e.alloc, t.storages[e.tensor].bytes);
  }
  ASSERT_GE(tail.size(), 11u);
  tail.erase(tail.begin(), tail.end() - 11);
  const std::vector<std::pair<bool, std::uint64_t>> want = {
      {true, x},  {true, x},  {true, x},                // pow's backward
      {false, x}, {false, x}, {false, x},               // its temporaries
      {false, x},                                       // the layer's input, with the frame
      {true, x},  {false, x}, {false, x}, {false, x}};  // the DTensor sum, then add_ into the residual's
  EXPECT_EQ(tail, want);
}

TEST(TensorXDataParallel, SequenceParallelNormGradientsAreAllReducedInThePostBackward) {
  // Measured (the trace of tp 2 x dp 2 --sequence-parallel, fp32 SGD b1 s64, layer 3's
  // post-backward in step 1; See Note [Partial gradients under FSDP2]): input_layernorm's and
  // then post_attention_layernorm's Partial gradient is all-reduced into a new 2,048 B tensor
  // and the Partial one freed, before the reshard frees the unsharded parameters (fsdp_params
  // order: q, k, v, o, gate, up, down, then the two norms).
  Recipe r = tpdp_recipe();
  r.sequence_parallel = true;
  r.validate();
  const graph::Trace t = graph::build_training_trace(llama_w512(), r, find_gpu("cpu"));
  const std::uint64_t q = 524'288, kv = 262'144, mlp = 2'097'152, norm = 2048;
  const std::vector<std::pair<bool, std::uint64_t>> want = {
      {true, norm}, {false, norm}, {true, norm}, {false, norm},  // the two all-reduces
      {false, q},   {false, kv},   {false, kv},  {false, q},    {false, mlp}, {false, mlp}, {false, mlp},
      {false, norm}, {false, norm},  // the reshard
      // The reduce-scatter input; the copy-in frees all but the last gradient, last first
      // (unsharded_grads.clear(): CPython drops a list's items from the end).
      {true, 7'868'416},
      {false, norm}, {false, mlp}, {false, mlp}, {false, mlp}, {false, q}, {false, kv}, {false, kv}, {false, q},
      {true, 3'934'208}, {true, 7'868'416}, {false, 7'868'416},  // output, gloo's settled temporary
      {false, norm}};  // post_attention_layernorm's all-reduced gradient, held to foreach_reduce's end
  EXPECT_EQ(backward_events_from(t, "fsdp.redistribute_grad", want.size()), want);
  // Four layers' two norms and the final norm, in each step.
  EXPECT_EQ(allocs_at(t, "fsdp.redistribute_grad"), std::vector<std::uint64_t>(2 * 9, norm));
  // Without sequence parallelism the norms' gradients are Replicate: nothing to redistribute.
  EXPECT_TRUE(allocs_at(graph::build_training_trace(llama_w512(), tpdp_recipe(), find_gpu("cpu")),
                        "fsdp.redistribute_grad")
                  .empty());
}

TEST(TensorXDataParallel, LossParallelShardsTheVocabShardOverDp) {
  // With loss_parallel lm_head's weight is Shard(0) on tp (vocab / 2 rows per rank) and FSDP2
  // splits those rows again over dp; its gradient has the parameter's placement, so nothing is
  // redistributed (the final norm is a plain Replicate module without sequence parallelism).
  // Measured: 17,273,856 B of SGD momentum on every rank (cpu-tp2dp2splp-llamaw512l4-fp32-sgd-b2s64).
  const Model m = llama_w512();
  Recipe r = tpdp_recipe();
  r.loss_parallel = true;
  r.validate();
  const graph::Trace t = graph::build_training_trace(m, r, find_gpu("cpu"));
  std::uint64_t sharded = 0;
  for (std::uint64_t b : allocs_at(t, "fsdp.fully_shard")) sharded += b;
  EXPECT_EQ(sharded, numel_of(graph::tensor_parallel_model(m, 2, /*loss_parallel=*/true)) * 4 / 2);
  EXPECT_EQ(sharded, 17'273'856u);
  EXPECT_TRUE(allocs_at(t, "fsdp.redistribute_grad").empty());
}

TEST(TensorXDataParallel, RefusesWhatIsNotMeasured) {
  EXPECT_NO_THROW(tpdp_recipe());
  Recipe r = tpdp_recipe();
  r.parallel = Parallel::kZero2;
  EXPECT_NE(error_of([&] { r.validate(); }).find("modelled under parallel fsdp only"), std::string::npos);
  r = tpdp_recipe();
  r.gpus = 1;
  EXPECT_NE(error_of([&] { r.validate(); }).find("gpus (the data-parallel degree) of 2 or more"), std::string::npos);
  r = tpdp_recipe();
  r.gpus = 4;
  r.fsdp.replicate = 2;
  EXPECT_NE(error_of([&] { r.validate(); }).find("not modelled with tensor parallelism"), std::string::npos);
  r = tpdp_recipe();
  r.fsdp.reshard_after_forward = false;
  EXPECT_NE(error_of([&] { r.validate(); }).find("keep FSDP2's defaults"), std::string::npos);
  r = tpdp_recipe();
  r.sequence_parallel = true;
  EXPECT_NO_THROW(r.validate());  // measured: cpu-tp2dp2sp-*
  r = tpdp_recipe();
  r.loss_parallel = true;
  EXPECT_NO_THROW(r.validate());  // measured: cpu-tp2dp2lp-*
  r.sequence_parallel = true;
  EXPECT_NO_THROW(r.validate());  // measured: cpu-tp2dp2splp-*
  r.precision = Precision::kFp16True;
  EXPECT_NE(error_of([&] { r.validate(); }).find("precision fp16-true is not modelled"), std::string::npos);
  r = tpdp_recipe();
  r.precision = Precision::kFp16True;
  EXPECT_NE(error_of([&] { r.validate(); }).find("precision fp16-true is not modelled"), std::string::npos);
}

}  // namespace
}  // namespace trainmem
