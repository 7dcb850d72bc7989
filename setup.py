"""Build fused_pool_gelu._C: CUDA kernels when possible, the CPU kernels always.

Knobs (environment variables):
  FUSED_POOL_GELU_CUDA   auto (default): build the CUDA kernels when torch is a CUDA build and a
                         CUDA toolkit is found; 1: require them (fail otherwise); 0: CPU only.
  CUDA_HOME              the CUDA toolkit (default: CUDA_PATH if set, else /usr/local/cuda when
                         it holds bin/nvcc). One that is set but holds no bin/nvcc is reported
                         and, in auto mode, gives a CPU-only build.
  TORCH_CUDA_ARCH_LIST   architectures to compile for (default "8.0;9.0a": sm_80 code runs on
                         compute capability 8.x, Ampere and Ada; 9.0a is Hopper's, with the wgmma
                         kernels). Other GPUs need their own entry, or "+PTX" on one (compiled
                         just in time there, without the Hopper-only kernels).
  FUSED_POOL_GELU_PTX_ONLY=1
                         compile each TORCH_CUDA_ARCH_LIST entry ("9.0", no "a") to PTX alone, no
                         binary: the driver JIT-compiles every kernel at load, as a GPU newer than
                         the wheel's binaries does with its PTX. A test build (scripts/device_run.sh
                         test-ptx), without the Hopper-only kernels (they have no PTX).
  MAX_JOBS               parallel compile jobs (ninja).
  NVCC_THREADS           nvcc --threads per job (default 2).
  DEBUG=1                -O0 -g host code, -g -G device code (unoptimised, for debuggers).
  FUSED_POOL_GELU_TORCH_HEADERS
                         other torch versions' C++ headers: directories named <major>.<minor>,
                         each holding that torch's include/ tree, separated by ":" (made by
                         scripts/torch_headers.py; `make wheels` passes them). A C++ autograd
                         node for model_forward is built against each, beside the one for the
                         torch that builds (csrc/autograd_node/).

The decision is made from torch.version.cuda and the toolkit on disk, never from
torch.cuda.is_available(): a build machine usually has no GPU.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup

ROOT = Path(__file__).parent.resolve()
# The oldest torch whose LibTorch stable ABI (torch/csrc/stable, torch/headeronly) has everything
# csrc/ calls: the binary loads under it and every later torch (parallel_for, empty, to,
# contiguous, the stable dispatcher and STD_CUDA_CHECK are 2.10's). The wheel requires it.
TORCH_TARGET = (2, 10)
DEFAULT_ARCH_LIST = "8.0;9.0a"
# Sources compiled for sm_90a only (wgmma kernels).
SM90A_SUFFIX = "_sm90a.cu"


def _version() -> str:
    text = (ROOT / "fused_pool_gelu" / "_version.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def _find_cuda_home():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        if (Path(home) / "bin" / "nvcc").exists():
            return home
        print(f"fused_pool_gelu: CUDA_HOME / CUDA_PATH = {home} holds no bin/nvcc: no CUDA toolkit",
              file=sys.stderr)
        return None
    default = Path("/usr/local/cuda")
    return str(default) if (default / "bin" / "nvcc").exists() else None


def _libstdcxx_link_args():
    """Make sure _C links the shared libstdc++ that torch itself uses.

    Some toolchains ship a g++ whose own directory holds only libstdc++.a (seen on a GPU image
    with CXX=/opt/gcc/bin/g++). Linking a Python extension against that static copy builds fine,
    then crashes at run time the first time the extension formats an error message: two copies of
    libstdc++'s locale state, one of them never initialised. When the compiler cannot find a
    shared libstdc++, name the libstdc++.so.6 loaded in this (torch-importing) process instead.
    """
    if not sys.platform.startswith("linux"):
        return []
    cxx = os.environ.get("CXX", "c++").split()
    try:
        found = subprocess.run(
            cxx + ["-print-file-name=libstdc++.so"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return []
    if os.path.isabs(found):
        return []
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libstdc++.so"):
                print(f"fused_pool_gelu: {cxx[0]} has no shared libstdc++; linking {path}")
                return [path]
    return []


def _has_sm90a(arch_list: str) -> bool:
    """Whether TORCH_CUDA_ARCH_LIST ("8.0;9.0a", "8.0 9.0a+PTX", ...) builds sm_90a code: the
    wgmma kernel exists only there."""
    return any(a.split("+")[0] == "9.0a" for a in re.split(r"[;\s]+", arch_list.strip()) if a)


def _ptx_only_gencode(arch_list: str) -> list:
    """nvcc flags for FUSED_POOL_GELU_PTX_ONLY=1: compute_XY PTX for each "X.Y" entry."""
    flags = []
    for entry in (a for a in re.split(r"[;\s]+", arch_list.strip()) if a):
        arch = entry.split("+")[0]
        if not re.fullmatch(r"\d+\.\d", arch):
            sys.exit(f"fused_pool_gelu: FUSED_POOL_GELU_PTX_ONLY=1 takes TORCH_CUDA_ARCH_LIST "
                     f'entries like "9.0" (PTX of a virtual architecture), got "{entry}" (the '
                     f'default list is "{DEFAULT_ARCH_LIST}": set one)')
        flags.append(f"-gencode=arch=compute_{arch.replace('.', '')},"
                     f"code=compute_{arch.replace('.', '')}")
    if not flags:  # torch would then add binaries of its own choosing
        sys.exit("fused_pool_gelu: FUSED_POOL_GELU_PTX_ONLY=1 needs TORCH_CUDA_ARCH_LIST to name "
                 'the PTX targets (e.g. "9.0"), got an empty list')
    return flags


def _want_cuda(torch_cuda, cuda_home) -> bool:
    mode = os.environ.get("FUSED_POOL_GELU_CUDA", "auto").lower()
    if mode in ("0", "false", "no", "off"):
        return False
    found = torch_cuda is not None and cuda_home is not None
    if mode in ("1", "true", "yes", "on") and not found:
        why = (
            "torch is a CPU-only build (torch.version.cuda is None); install a CUDA build of torch"
            if torch_cuda is None
            else "no CUDA toolkit found: set CUDA_HOME to a directory holding bin/nvcc"
        )
        sys.exit(f"fused_pool_gelu: FUSED_POOL_GELU_CUDA=1 but {why}.")
    return found


def _extension():
    try:
        import torch
    except ImportError:
        sys.exit(
            "fused_pool_gelu: building needs torch in the build environment. Install torch first, "
            "then build without isolation: pip install --no-build-isolation ."
        )

    cuda_home = _find_cuda_home()
    with_cuda = _want_cuda(torch.version.cuda, cuda_home)
    if with_cuda:
        # torch.utils.cpp_extension reads CUDA_HOME when imported: set it first, so that a
        # wrapper `nvcc` on PATH cannot mislead its guess.
        os.environ["CUDA_HOME"] = cuda_home
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    debug = os.environ.get("DEBUG", "0") == "1"
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "") if with_cuda else ""
    ptx_only = with_cuda and os.environ.get("FUSED_POOL_GELU_PTX_ONLY", "0") == "1"
    with_sm90a = _has_sm90a(archs) and not ptx_only
    major, minor = TORCH_TARGET
    macros = [
        # Only the stable ABI of TORCH_TARGET: newer stable APIs and every non-stable header
        # (ATen, c10, torch/library.h) stay out of reach.
        ("TORCH_TARGET_VERSION", f"0x{major:02x}{minor:02x}000000000000"),
        ("FPG_TORCH_TARGET", f'"{major}.{minor}"'),
        ("FPG_TORCH_VERSION", f'"{torch.__version__}"'),
        ("FPG_CUDA_VERSION", f'"{torch.version.cuda if with_cuda else ""}"'),
        ("FPG_CUDA_ARCHS", f'"{archs} (PTX only)"' if ptx_only else f'"{archs}"'),
        ("FPG_WITH_SM90A", "1" if with_sm90a else "0"),
        ("FPG_WITH_CUDA", "1" if with_cuda else "0"),
        ("FPG_DEBUG", "1" if debug else "0"),
    ]
    if with_cuda:
        macros.append(("USE_CUDA", "1"))  # the stable ABI's CUDA shims (streams, error checks)
    host_flags = ["-O0", "-g"] if debug else ["-O3"]
    # No fused multiply-adds in host code: the CPU backward's sums round every product, as the CUDA
    # kernels' do, so that the two agree bit for bit (csrc/summation_order.h). x86-64 without
    # -march has no FMA anyway; GCC on aarch64 would contract by default.
    host_flags += ["-ffp-contract=off", "-fdiagnostics-color=always"]
    link_args = _libstdcxx_link_args()
    sources = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "csrc").glob("*.cpp"))]
    sources += [str(p.relative_to(ROOT)) for p in sorted((ROOT / "csrc" / "cpu").glob("*.cpp"))]
    if not with_cuda:
        return CppExtension(
            "fused_pool_gelu._C",
            sources,
            include_dirs=[str(ROOT / "csrc")],
            define_macros=macros,
            extra_compile_args={"cxx": host_flags},
            extra_link_args=link_args,
            py_limited_api=True,
        )

    nvcc_flags = [
        "-O3",
        # IEEE float32 on the device: denormals kept, exact division and square root.
        "-ftz=false",
        "-prec-div=true",
        "-prec-sqrt=true",
        "--expt-relaxed-constexpr",
        f"--threads={os.environ.get('NVCC_THREADS', '2')}",
        "-Xptxas=-warn-spills",
    ]
    # DEBUG: device debug info without device optimisation (cuda-gdb, compute-sanitizer lines).
    nvcc_flags += ["-g", "-G"] if debug else ["-lineinfo"]
    # The *_sm90a.cu units hold only Hopper's wgmma kernels: compiled for sm_90a alone
    # (BuildExtension below), and left out of builds whose arch list lacks 9.0a.
    cuda_sources = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
    if ptx_only:
        nvcc_flags += _ptx_only_gencode(archs)  # torch adds no arch flags where these are
    if not with_sm90a:
        cuda_sources = [p for p in cuda_sources if not p.name.endswith(SM90A_SUFFIX)]
    sources += [str(p.relative_to(ROOT)) for p in cuda_sources]
    return CUDAExtension(
        "fused_pool_gelu._C",
        sources,
        include_dirs=[str(ROOT / "csrc")],
        define_macros=macros,
        extra_compile_args={"cxx": host_flags, "nvcc": nvcc_flags},
        extra_link_args=link_args,
        py_limited_api=True,
    )


def _model_forward_nodes():
    """csrc/autograd_node/, built once per torch minor version against that version's own headers
    (full C++ API, no stable ABI): fused_pool_gelu/_model_forward_node_torch<major>_<minor>.so,
    which _autograd.py loads under that torch. The torch that builds gives its own headers; the
    others come from FUSED_POOL_GELU_TORCH_HEADERS. No Python and no device code: one node serves
    every Python and both the CPU and the CUDA builds of its torch. It links against the build
    torch's libc10 and libtorch_cpu only for their names (DT_NEEDED), which resolve to the running
    torch's libraries at load time."""
    import torch
    from torch.utils.cpp_extension import include_paths, library_paths

    own = re.match(r"(\d+)\.(\d+)", torch.__version__)
    headers = {(own[1], own[2]): include_paths()}
    for entry in filter(None, os.environ.get("FUSED_POOL_GELU_TORCH_HEADERS", "").split(":")):
        tree = Path(entry).resolve()
        version = re.fullmatch(r"(\d+)\.(\d+)", tree.name)
        if version is None or not (tree / "include" / "torch").is_dir():
            sys.exit(f"fused_pool_gelu: FUSED_POOL_GELU_TORCH_HEADERS names {entry}, which is not "
                     "a <major>.<minor> directory holding a torch include/ tree (made by "
                     "scripts/torch_headers.py)")
        headers.setdefault((version[1], version[2]),
                           [str(tree / "include"),
                            str(tree / "include" / "torch" / "csrc" / "api" / "include")])
    debug = os.environ.get("DEBUG", "0") == "1"
    node_dir = ROOT / "csrc" / "autograd_node"
    return [
        Extension(
            f"fused_pool_gelu._model_forward_node_torch{major}_{minor}",
            [str((node_dir / "model_forward_node.cpp").relative_to(ROOT))],
            include_dirs=[str(node_dir)] + includes,
            library_dirs=library_paths(),
            libraries=["c10", "torch_cpu"],
            # Recent torch headers need C++20 (2.14's do); older ones compile under it too.
            extra_compile_args={"cxx": ["-std=c++20"]
                                + (["-O0", "-g"] if debug else ["-O2", "-g0"])},
            language="c++",
            py_limited_api=True,
        )
        for (major, minor), includes in sorted(headers.items())
    ]


def _build_ext():
    from torch.utils.cpp_extension import BuildExtension

    class BuildExtensionWithSm90a(BuildExtension):
        """BuildExtension that compiles the *_sm90a.cu sources for sm_90a alone.

        torch's ninja build gives every source the same flags (the TORCH_CUDA_ARCH_LIST targets);
        the Hopper-only units would compile to empty kernels for every other target. They are
        compiled first, in a ninja run of their own whose nvcc flags name the one target (torch
        adds no arch flags where the flags already hold one), and linked in as objects.
        """

        def build_extension(self, ext):
            hopper = [s for s in ext.sources if s.endswith(SM90A_SUFFIX)]
            if hopper:
                ext.sources = [s for s in ext.sources if s not in hopper]
                flags = dict(ext.extra_compile_args)
                flags["nvcc"] = list(flags["nvcc"]) + ["-gencode=arch=compute_90a,code=sm_90a"]
                objects = self.compiler.compile(
                    hopper,
                    output_dir=os.path.join(self.build_temp, "sm90a"),
                    macros=ext.define_macros,
                    include_dirs=ext.include_dirs,
                    debug=self.debug,
                    extra_postargs=flags,
                    depends=ext.depends,
                )
                ext.extra_objects = list(ext.extra_objects or []) + objects
                # Still a dependency of the link: a changed sm_90a unit alone must relink.
                ext.depends = list(ext.depends or []) + hopper
            super().build_extension(ext)

    return BuildExtensionWithSm90a.with_options(no_python_abi_suffix=True)


setup(
    name="fused_pool_gelu",
    version=_version(),
    packages=find_packages(include=["fused_pool_gelu", "fused_pool_gelu.*"]),
    ext_modules=[_extension()] + _model_forward_nodes(),
    cmdclass={"build_ext": _build_ext()},
    # The module stub uses only the stable C API (py_limited_api above), which torch's
    # cpp_extension compiles against CPython 3.10's (-DPy_LIMITED_API=0x030A0000): one wheel serves
    # every CPython >= 3.10 with the torch it was built against.
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
