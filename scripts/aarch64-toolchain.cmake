# CMake toolchain file: cross-build normuon for aarch64 (Arm64 Linux, e.g. NVIDIA GB10's CPU) on a Debian
# amd64 host with Debian's cross compiler, and run what it builds under qemu-user. Used by
# scripts/cross-aarch64.sh, which installs what this file expects:
#   - g++-aarch64-linux-gnu (the compiler, its libc and libstdc++ under /usr/aarch64-linux-gnu);
#   - the arm64 -dev packages that install beside the amd64 ones (multiarch: /usr/lib/aarch64-linux-gnu);
#   - a private sysroot, NORMUON_AARCH64_SYSROOT (default build-aarch64/sysroot), holding the arm64 packages
#     that cannot be installed beside their amd64 versions (libtorch-dev, libdnnl-dev and what they pull in),
#     unpacked from their .debs without registering them with dpkg.
#   - qemu-user (qemu-aarch64), the CMAKE_CROSSCOMPILING_EMULATOR that CTest runs the tests with.

set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)

set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)

# The private sysroot: -DNORMUON_AARCH64_SYSROOT=..., else the environment's, else build-aarch64/sysroot.
if(NOT NORMUON_AARCH64_SYSROOT)
  if(DEFINED ENV{NORMUON_AARCH64_SYSROOT})
    set(NORMUON_AARCH64_SYSROOT "$ENV{NORMUON_AARCH64_SYSROOT}")
  else()
    get_filename_component(NORMUON_AARCH64_SYSROOT "${CMAKE_CURRENT_LIST_DIR}/../build-aarch64/sysroot" ABSOLUTE)
  endif()
endif()
# try_compile projects read this file again: hand them the same sysroot.
list(APPEND CMAKE_TRY_COMPILE_PLATFORM_VARIABLES NORMUON_AARCH64_SYSROOT)

# Where find_* look: the private sysroot first, then the host's root (whose multiarch directories,
# /usr/lib/aarch64-linux-gnu and /usr/include, hold the co-installable arm64 packages). Programs (protoc,
# git) are the host's; libraries, headers and packages only ever come from these roots.
set(CMAKE_FIND_ROOT_PATH "${NORMUON_AARCH64_SYSROOT}" "/")
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# The linker must find the libraries that the sysroot's shared libraries need (libtorch_cpu.so needs
# protobuf, glog, opencv...): they are not in its default directories. Some are not multiarch
# (libgloo.so.0 is in usr/lib). scripts/cross-aarch64.sh gives the emulated programs the same list.
set(_normuon_aarch64_libdirs "${NORMUON_AARCH64_SYSROOT}/usr/lib/aarch64-linux-gnu:${NORMUON_AARCH64_SYSROOT}/lib/aarch64-linux-gnu:${NORMUON_AARCH64_SYSROOT}/usr/lib")
set(CMAKE_EXE_LINKER_FLAGS_INIT "-Wl,-rpath-link,${_normuon_aarch64_libdirs}")
set(CMAKE_SHARED_LINKER_FLAGS_INIT "-Wl,-rpath-link,${_normuon_aarch64_libdirs}")

# Running the aarch64 executables (CTest, try_run): qemu-aarch64 with the cross toolchain's loader (-L),
# and a library path for the guest only (-E): the cross toolchain's libc/libstdc++ first (the ones the
# programs were linked against), then the private sysroot's libraries.
set(CMAKE_CROSSCOMPILING_EMULATOR
    qemu-aarch64 -L /usr/aarch64-linux-gnu
    -E "LD_LIBRARY_PATH=/usr/aarch64-linux-gnu/lib:${_normuon_aarch64_libdirs}")
