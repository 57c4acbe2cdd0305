// The reference backend: a literal, per-parameter transcription of docs/spec.md in ATen ops, one
// parameter at a time, the way per-parameter PyTorch optimizers run today. It is the oracle every other
// backend is checked against, and the "old" path of the old-vs-new comparison.
#pragma once

#include <ATen/ATen.h>

#include "normuon/backend.h"

namespace normuon {

class ReferenceBackend : public Backend {
 public:
  std::string name() const override { return "reference-cpu"; }
  StepResult step(FlatState& state, const Options& options) override;
};

// The spec's pieces, exposed for the invariant tests. All tensors are fp32 unless said.
// Newton-Schulz orthogonalisation of a 2-D fp32 tensor in the group's precision (fp32 result holding
// values of that precision).
at::Tensor newton_schulz(const at::Tensor& update, const NorMuonHyper& h);
// One NorMuon step of one matrix, in place on p, M (momentum) and v (second moment).
// `times` (optional) receives the time of each phase.
void normuon_update(at::Tensor p, const at::Tensor& g, at::Tensor M, at::Tensor v, const NorMuonHyper& h,
                    bool stats_per_row, PhaseTimes* times = nullptr);
// One AdamW step (torch.optim.AdamW, single-tensor path) of one tensor at group step t >= 1.
void adamw_update(at::Tensor p, const at::Tensor& g, at::Tensor m, at::Tensor v, const AdamWHyper& h, int64_t t,
                  PhaseTimes* times = nullptr);

}  // namespace normuon
