"""Compile the `qmm_sm80` JIT source embedded in a CUDA libmlx.so with NVRTC, for sm_90a, on a
machine without a GPU: checks that scripts/gpu/patch_libmlx.py left source NVRTC still builds.

    python3 scripts/gpu/nvrtc_qmm_check.py LIBMLX NVRTC_LIB INCLUDE_DIR...

LIBMLX: the (patched) libmlx.so; NVRTC_LIB: libnvrtc.so.13 (PyPI nvidia-cuda-nvrtc 13.0);
INCLUDE_DIRs as libmlx passes them (the wheel's mlx/include and mlx/include/cccl, the CUDA
headers of nvidia-cuda-runtime plus nvidia-cuda-crt), and one holding
mlx/backend/cuda/device/*.cuh (libmlx hands those to NVRTC from memory). Instantiates the
bf16 4-bit kernel at the 16-row tile and both group sizes 32 and 64, and prints NVRTC's log on
failure.
"""

import ctypes
import hashlib
import sys


def embedded_source(path):
    data = open(path, "rb").read()
    at = data.find(b"union SharedStorage")
    while at >= 0:
        start = data.rfind(b"\0", 0, at) + 1
        end = data.find(b"\0", at)
        src = data[start:end]
        if b"qmm_sm80_kernel" in src:
            return src
        at = data.find(b"union SharedStorage", end)
    raise SystemExit("no qmm_sm80 source in " + path)


def main():
    if len(sys.argv) < 4:
        raise SystemExit(__doc__.split("\n\n")[1])
    lib, nvrtc_path, includes = sys.argv[1], sys.argv[2], sys.argv[3:]
    src = embedded_source(lib)
    print("patched" if b"cp_async_wait<0>" in src else "unpatched", "qmm_sm80 source,", len(src), "bytes")
    nv = ctypes.CDLL(nvrtc_path)
    ok = True
    for gs in (32, 64):
        tile_k = max(64, gs)
        name = (f"mlx::core::cu::qmm_sm80_kernel<{gs}, cutlass::bfloat16_t, cutlass::uint4b_t, cutlass::bfloat16_t, "
                f"cute::Shape<cute::Int<16>, cute::Int<128>, cute::Int<{tile_k}>>>").encode()
        prog = ctypes.c_void_p()
        assert nv.nvrtcCreateProgram(ctypes.byref(prog), src, b"qmm_sm80_check.cu", 0, None, None) == 0
        assert nv.nvrtcAddNameExpression(prog, name) == 0
        opts = [b"--device-as-default-execution-space", b"--gpu-architecture=sm_90a"]
        opts += [b"--include-path=" + p.encode() for p in includes]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = nv.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value + 1)
        nv.nvrtcGetProgramLog(prog, log)
        cubin, digest = ctypes.c_size_t(), ""
        if rc == 0:
            nv.nvrtcGetCUBINSize(prog, ctypes.byref(cubin))
            buf = ctypes.create_string_buffer(cubin.value)
            nv.nvrtcGetCUBIN(prog, buf)
            digest = ", sha256 " + hashlib.sha256(buf.raw).hexdigest()[:16]
        print(f"group size {gs}: nvrtc {rc}, cubin {cubin.value} bytes{digest}")
        if rc != 0:
            print(log.value.decode(errors="replace")[-4000:])
            ok = False
        nv.nvrtcDestroyProgram(ctypes.byref(prog))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
