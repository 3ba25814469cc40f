#!/usr/bin/env python3
"""How long the driver takes to load each kernel module: its PTX (compiled by the driver)
against its committed sm_90 cubin (loaded as it is). Not shipped; a measurement for the
GPU machine, where no Rust toolchain is needed.

Run it with the compute cache off, so that every PTX load compiles:

    CUDA_CACHE_DISABLE=1 python3 bench/cuda/module_load.py [--rounds N]

Each round loads every module once from its PTX and once from its cubin into the device's
primary context (cuModuleLoadData, then cuModuleUnload), and prints milliseconds.
"""

import argparse
import ctypes
import glob
import os
import time


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUresult {rc}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    cuda = ctypes.CDLL("libcuda.so.1")
    check(cuda.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    name = ctypes.create_string_buffer(256)
    check(cuda.cuDeviceGetName(name, 256, dev), "cuDeviceGetName")
    ctx = ctypes.c_void_p()
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    print(f"{name.value.decode()}; CUDA_CACHE_DISABLE={os.environ.get('CUDA_CACHE_DISABLE', '')}")
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    cubins = sorted(glob.glob(os.path.join(root, "crates/*/kernels/ptx/*.sm_90.cubin")))
    if not cubins:
        raise SystemExit("no crates/*/kernels/ptx/*.sm_90.cubin (run `cargo xtask ptx`)")

    def load_ms(image):
        module = ctypes.c_void_p()
        t = time.perf_counter()
        check(cuda.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
        ms = (time.perf_counter() - t) * 1e3
        check(cuda.cuModuleUnload(module), "cuModuleUnload")
        return ms

    for r in range(args.rounds):
        for cubin in cubins:
            ptx = cubin.replace(".sm_90.cubin", ".ptx")
            with open(ptx, "rb") as f:
                ptx_image = ctypes.create_string_buffer(f.read())  # NUL-terminated
            with open(cubin, "rb") as f:
                cubin_image = ctypes.create_string_buffer(f.read())
            p, c = load_ms(ptx_image), load_ms(cubin_image)
            rel = os.path.relpath(ptx, root)
            print(f"round {r + 1} {rel:45s} ptx {p:9.1f} ms   cubin {c:7.1f} ms")


if __name__ == "__main__":
    main()
