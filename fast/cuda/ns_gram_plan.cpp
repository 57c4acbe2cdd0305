#include "ns_gram_plan.h"

namespace normuon::cuda {
namespace {

// The spec with X read from (and, for apply, written to) the other X buffer.
NsOperand other_x(NsOperand o) { return o == NsOperand::x ? NsOperand::u : o == NsOperand::u ? NsOperand::x : o; }
NsGemmSpec from_the_other_x(NsGemmSpec g) {
  g.a.operand = other_x(g.a.operand);
  g.b.operand = other_x(g.b.operand);
  g.d.operand = other_x(g.d.operand);
  return g;
}

// The square GEMM's layout (s x s, N,N, ld s) on other buffers.
NsGemmSpec square(const NsGemmPlan& plan, NsOperand a, NsOperand b, NsOperand d) {
  NsGemmSpec g = plan.square;
  g.a.operand = a;
  g.b.operand = b;
  g.d.operand = d;
  return g;
}

}  // namespace

int ns_gram_applies(int steps) { return ns_gram_products(steps).apply; }

int ns_gram_launches(int steps, int panels) {
  const NsGramProducts p = ns_gram_products(steps);
  int kernels = 2 /* norms */ + p.gram /* mirror of X X^T and C */;
  for (int k = 0; k < steps; ++k) {
    const NsGramIteration it = ns_gram_iteration(k, steps);
    kernels += 1;                                  // the Z kernel
    kernels += !it.fresh || it.update_r ? 1 : 0;   // the Q / RZ kernel
    kernels += it.update_r ? 1 : 0;                // the R kernel
  }
  return kernels + p.apply + panels * (p.gram + p.square);
}

NsGramPlan ns_gram_plan(const NsGemmPlan& plan) {
  NsGramPlan g{};
  g.gram_x = plan.gram;
  g.gram_u = from_the_other_x(plan.gram);
  g.c_r = plan.square;  // C (in the B buffer) times R (in the gram buffer), into T
  g.q_z = square(plan, NsOperand::q, NsOperand::z, NsOperand::t);
  g.r_z = square(plan, NsOperand::gram, NsOperand::z, NsOperand::t2);
  g.z_rz = square(plan, NsOperand::z, NsOperand::b, NsOperand::t);
  g.apply_x_to_u = plan.apply;  // the s x s operand is Q instead of B
  for (NsMatrixSpec* m : {&g.apply_x_to_u.a, &g.apply_x_to_u.b})
    if (m->operand == NsOperand::b) m->operand = NsOperand::q;
  g.apply_u_to_x = from_the_other_x(g.apply_x_to_u);
  return g;
}

}  // namespace normuon::cuda
