// LoRA target modules: which linear layers of a decoder layer peft can wrap, and how the
// `lora_targets` knob resolves for one architecture.
//
// Note [LoRA targets]
// peft matches each target name against the end of a module's qualified name, so "c_proj" on
// GPT-2 wraps both attn.c_proj and mlp.c_proj, and "q_proj" wraps every layer's
// self_attn.q_proj. "default" is peft's per-model default (q_proj and v_proj for the Llama
// family, c_attn for GPT-2; peft has none for Phi-3, so it must be named there). "all-linear" is
// every linear layer inside the decoder layers; the output layer (lm_head) is never wrapped.
#include <algorithm>
#include <string>

#include "common/checked.h"

namespace trainmem {

std::vector<std::string> lora_target_modules(const Architecture& a) {
  if (a.family == Family::kGpt2) return {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"};
  if (a.fused_qkv) {
    return {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"};
  }
  return {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};
}

namespace {

bool matches(const std::string& module, const std::string& target) {
  if (module == target) return true;
  return module.size() > target.size() && module.compare(module.size() - target.size(), target.size(), target) == 0 &&
         module[module.size() - target.size() - 1] == '.';
}

}  // namespace

std::vector<std::string> resolve_lora_targets(const Architecture& a, const std::vector<std::string>& spelled) {
  const std::vector<std::string> modules = lora_target_modules(a);
  std::vector<std::string> wanted = spelled;
  if (wanted.empty() || (wanted.size() == 1 && wanted[0] == "default")) {
    if (a.family == Family::kGpt2) wanted = {"c_attn"};
    else if (a.fused_qkv) {
      throw Error("lora_targets: peft has no default target modules for " + std::string(family_name(a.family)) +
                  "; name them (qkv_proj, o_proj, gate_up_proj, down_proj) or use all-linear");
    } else wanted = {"q_proj", "v_proj"};
  }
  if (wanted.size() == 1 && wanted[0] == "all-linear") return modules;
  std::vector<std::string> out;
  for (const std::string& t : wanted) {
    if (t == "default" || t == "all-linear") {
      throw Error("lora_targets: '" + t + "' cannot be combined with module names");
    }
    bool any = false;
    for (const std::string& m : modules) {
      if (matches(m, t)) {
        any = true;
        if (std::find(out.begin(), out.end(), m) == out.end()) out.push_back(m);
      }
    }
    if (!any) {
      std::string valid;
      for (const std::string& m : modules) valid += (valid.empty() ? "" : ", ") + m.substr(m.rfind('.') + 1);
      throw Error("lora_targets: '" + t + "' names no linear layer of " + std::string(family_name(a.family)) +
                  " decoder layers; expected some of " + valid + ", default or all-linear");
    }
  }
  // The order of the decoder layer's modules, whatever order they were named in.
  std::vector<std::string> ordered;
  for (const std::string& m : modules) {
    if (std::find(out.begin(), out.end(), m) != out.end()) ordered.push_back(m);
  }
  return ordered;
}

}  // namespace trainmem
