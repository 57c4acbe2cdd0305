// NORMUON_MULTIVERSION: one clone of a function per x86-64 level, picked at load time (AVX-512 where the
// CPU has it, AVX2 else, the baseline otherwise), for the loops the compiler vectorises. Never assumed:
// elsewhere (other compilers, other architectures) the one plain version.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define NORMUON_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define NORMUON_MULTIVERSION
#endif
