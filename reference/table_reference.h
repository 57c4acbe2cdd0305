// The reference over the caller's own tensors (table mode, param_table.h), without libtorch: the spec's
// per-parameter steps (spec_steps.h) on the CPU's primitives, one parameter after another, so that the
// Python package (normuon._C, which links no libtorch) steps with the very arithmetic of reference/ and
// its bits follow from the spec on every processor. Each parameter is read into fp32 (its master, or the
// fp32 tensor itself), stepped, and a bf16 / fp16 one written back rounded, as the fast backends do.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "normuon/engine.h"

namespace normuon {

namespace spec {
class CpuOps;
}

class ReferenceTableBackend : public TableBackend {
 public:
  explicit ReferenceTableBackend(const Layout& layout);
  ~ReferenceTableBackend() override;
  std::string name() const override { return "reference-cpu"; }
  // The NaN/Inf check and the counters of begin_step, then the spec's step of every parameter with a
  // gradient; gradients are divided by *grad_scale (when given) as they are read.
  StepResult step(TableState& state, const ParamTable& table, const Options& options,
                  const float* grad_scale) override;
  int64_t workspace_bytes() const override;  // the copies and the spec's scratch held now

 private:
  std::unique_ptr<spec::CpuOps> ops_;
  StepOperands operands_;
  std::vector<float> grad_, param_;  // a parameter's fp32 gradient, and its values where they are not dense
  // (the spec's own scratch, in ops_, grows to the largest matrix in the first steps)
};

}  // namespace normuon
