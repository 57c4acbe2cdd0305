"""pip's build of `normuon` (metadata: pyproject.toml): the pure-Python files from python/normuon, and the
native modules normuon._C (and, where CMake finds the CUDA toolkit, normuon._C_cuda) built by the project's own CMake build (python/CMakeLists.txt) and copied in.

    pip install --no-build-isolation .                      # offline: the system's setuptools and wheel
    NORMUON_CMAKE_BUILD_DIR=build pip install --no-build-isolation .   # reuse a CMake build folder

Everything pip and CMake write goes to a temporary folder (removed at exit) or to NORMUON_CMAKE_BUILD_DIR,
never into the source tree: the repository's build/ is the CMake build folder, not setuptools'.
"""
import atexit
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.egg_info import egg_info

try:
    from setuptools.command.build import build
except ImportError:  # setuptools < 62.4
    from distutils.command.build import build

ROOT = os.path.dirname(os.path.abspath(__file__))
_scratch = []


def scratch_dir():
    """One temporary folder per process for setuptools' build and egg-info folders."""
    if not _scratch:
        path = tempfile.mkdtemp(prefix="normuon-setup-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        _scratch.append(path)
    return _scratch[0]


class OutOfTreeBuild(build):
    def initialize_options(self):
        super().initialize_options()
        self.build_base = os.path.join(scratch_dir(), "build")


class OutOfTreeEggInfo(egg_info):
    def initialize_options(self):
        super().initialize_options()
        self.egg_base = scratch_dir()


class CMakeBuild(build_ext):
    """Configures (unless the folder is configured already) and builds the CMake targets _C and, in a build
    with CUDA, _C_cuda, then copies the modules where setuptools expects them."""

    def build_extension(self, ext):
        cmake = shutil.which("cmake")
        if cmake is None:
            sys.exit("normuon: building normuon._C needs cmake (Debian: apt-get install cmake ninja-build; "
                     "the build dependencies are listed by scripts/setup.sh)")
        build_dir = os.environ.get("NORMUON_CMAKE_BUILD_DIR") or os.path.join(os.path.abspath(self.build_temp), "cmake")
        if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            configure = [cmake, "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
                         "-DNORMUON_BUILD_PYTHON=ON", "-DNORMUON_BUILD_FAST_CPU=ON",
                         "-DNORMUON_BUILD_REFERENCE=OFF",  # the libtorch reference is not part of the package
                         "-DNORMUON_BUILD_TESTS=OFF", f"-DPYTHON_EXECUTABLE={sys.executable}"]
            if shutil.which("ninja"):
                configure += ["-G", "Ninja"]
            subprocess.check_call(configure)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        # normuon._C_cuda (the CUDA backend, a module of its own so that _C never needs the CUDA runtime)
        # where CMake found the toolkit; it goes next to _C.
        with open(os.path.join(build_dir, "CMakeCache.txt")) as cache:
            has_cuda = "NORMUON_BUILD_CUDA:BOOL=ON" in cache.read()
        modules = ["_C", "_C_cuda"] if has_cuda else ["_C"]
        subprocess.check_call([cmake, "--build", build_dir, "-j", jobs, "--target", *modules])
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        for module in modules:
            built = glob.glob(os.path.join(build_dir, "python", "normuon", module + suffix))
            if len(built) != 1:
                sys.exit(f"normuon: expected {module}{suffix} in {build_dir}/python/normuon, found {built} (was the "
                         f"CMake folder configured for another Python than {sys.executable}?)")
            shutil.copyfile(built[0], os.path.join(os.path.dirname(target), module + suffix))


setup(ext_modules=[Extension("normuon._C", sources=[])],
      cmdclass={"build": OutOfTreeBuild, "egg_info": OutOfTreeEggInfo, "build_ext": CMakeBuild})
