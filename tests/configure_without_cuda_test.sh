#!/usr/bin/env bash
# A machine without the CUDA toolkit: configuring must work (it said "no CUDA compiler" and stopped
# before), say that the CUDA backend is left out, and build a Python module that neither needs nor links
# the CUDA runtime. The toolkit is hidden here by pointing CUDACXX at nothing.
set -euo pipefail
src=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export CUDACXX=/nonexistent/nvcc
log="$work/configure.log"
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DNORMUON_BUILD_REFERENCE=OFF \
      -DNORMUON_BUILD_TESTS=OFF >"$log" 2>&1 || { cat "$log"; echo "FAIL: configure without CUDA"; exit 1; }
grep -q "no CUDA toolkit found" "$log" || { cat "$log"; echo "FAIL: no line says the CUDA backend is left out"; exit 1; }
grep -q "NORMUON_BUILD_CUDA:BOOL=OFF" "$work/build/CMakeCache.txt" || { echo "FAIL: NORMUON_BUILD_CUDA is not OFF"; exit 1; }
cmake --build "$work/build" --target _C -j "$(nproc)" >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; echo "FAIL: build"; exit 1; }
module=$(ls "$work"/build/python/normuon/_C.*so)
libs=$(ldd "$module")  # (not piped into grep -q: under pipefail, ldd's SIGPIPE would hide a match)
if grep -q cudart <<<"$libs"; then echo "$libs"; echo "FAIL: the module links the CUDA runtime"; exit 1; fi
if compgen -G "$work/build/python/normuon/_C_cuda*" >/dev/null; then echo "FAIL: a CUDA module in a build without CUDA"; exit 1; fi
python=$(command -v /usr/bin/python3 || command -v python3)
PYTHONPATH="$work/build/python" "$python" -c "
import normuon._C as C
from normuon import optim
reason = optim.cuda_unavailable_reason(0)
assert 'no CUDA backend' in reason, reason
print('imports; fast CPU backend:', hasattr(C, 'FastCpuBackend'), '; CUDA:', reason)"
echo "PASS: configure, build and import without CUDA"
