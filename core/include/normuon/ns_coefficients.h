// The Newton-Schulz coefficient schedules of docs/spec.md section 3.2, shared by every backend.
#pragma once

#include "normuon/options.h"

namespace normuon {

struct NsTriple {
  double a, b, c;
};

// Keller Jordan's quintic, the same in every iteration (official NorMuon, Muon, torch.optim.Muon).
constexpr NsTriple kQuinticCoefficients{3.4445, -4.7750, 2.0315};

// Polar Express (arXiv 2505.16932), one triple per iteration, computed for a 2% safety factor.
constexpr int kPolarExpressSteps = 5;
constexpr NsTriple kPolarExpressCoefficients[kPolarExpressSteps] = {
    {8.156554524902461, -22.48329292557795, 15.878769915207462},
    {4.042929935166739, -2.808917465908714, 0.5000178451051316},
    {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
    {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
    {2.3465413258596377, -1.7097828382687081, 0.42323551169305323},
};
constexpr double kPolarExpressSafety = 1.02;  // X / (1.02 ||X|| + eps)

// The triple of iteration k (0-based). The caller has checked ns_steps against the schedule.
constexpr const NsTriple& ns_triple(NsCoefficients schedule, int k) {
  return schedule == NsCoefficients::quintic ? kQuinticCoefficients : kPolarExpressCoefficients[k];
}

}  // namespace normuon
