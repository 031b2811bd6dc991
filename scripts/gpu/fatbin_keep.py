#!/usr/bin/env python3
"""Trim the CUDA fat binaries inside a shared library to one SASS architecture.

    fatbin_keep.py IN.so OUT.so 90

Every CUDA fatbin container in the ELF section `.nv_fatbin` holds one entry per target
(SASS for sm_75/80/90/100/120/121 and PTX for the newest in the mlx-cuda-13 wheel). This
zeroes the payload of every entry except SASS for the architecture asked for, leaving all
headers and offsets as they are: the file keeps its size and layout, but the zeroed bytes
compress to nothing (libmlx.so of mlx-cuda-13 0.32.2: xz -9 gives ~14 MiB instead of ~66).
The result only runs on that architecture (sm_90 = H100/H200): the CUDA runtime picks the
matching SASS entry and never looks at the zeroed ones.

Our own port of the reference script in the shared notes (mlx-linux-files/fatbin_keep.py):
it reads the ELF section table itself (no readelf), checks each container's bounds, and
fails if a container ends up with no entry for the kept architecture.
"""
import struct
import sys

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_SASS = 1, 2


def section(data: bytes, want: str):
    """(offset, size) of ELF64 little-endian section `want`."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        sys.exit("not an ELF64 little-endian file")
    e_shoff, = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    def sh(i):
        # name, type, flags, addr, offset, size
        return struct.unpack_from("<IIQQQQ", data, e_shoff + i * e_shentsize)
    stroff = sh(e_shstrndx)[4]
    for i in range(e_shnum):
        name, _, _, _, off, size = sh(i)
        end = data.index(b"\0", stroff + name)
        if data[stroff + name:end].decode() == want:
            return off, size
    sys.exit(f"no section {want}")


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    src, dst, keep = sys.argv[1], sys.argv[2], int(sys.argv[3])
    data = bytearray(open(src, "rb").read())
    off, size = section(data, ".nv_fatbin")
    pos, end_sec = off, off + size
    containers = kept = zeroed = 0
    missing = 0
    seen = {}
    while pos + 16 <= end_sec:
        magic, _ver, hsz, fsz = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # containers are 8-byte aligned, padding between them
            continue
        containers += 1
        p, end = pos + hsz, pos + hsz + fsz
        if end > end_sec:
            sys.exit(f"container at {pos:#x} runs past .nv_fatbin")
        has_keep = False
        while p < end:
            kind, _unk, ehs, psz = struct.unpack_from("<HHIQ", data, p)
            arch, = struct.unpack_from("<I", data, p + 28)
            tag = ("sass" if kind == KIND_SASS else "ptx" if kind == KIND_PTX else f"kind{kind}") + f"_{arch}"
            seen[tag] = seen.get(tag, 0) + psz
            if p + ehs + psz > end or ehs == 0:
                sys.exit(f"bad entry at {p:#x}")
            if kind == KIND_SASS and arch == keep:
                kept += psz
                has_keep = True
            else:
                data[p + ehs:p + ehs + psz] = bytes(psz)
                zeroed += psz
            p += ehs + psz
        missing += not has_keep
        pos = end
    if containers == 0:
        sys.exit("no fatbin containers found")
    if missing:
        sys.exit(f"{missing} of {containers} containers have no sm_{keep} SASS: the result would lack kernels")
    open(dst, "wb").write(data)
    mib = lambda n: f"{n / 2**20:.1f} MiB"
    print(f"{containers} containers; kept sm_{keep} SASS {mib(kept)}, zeroed {mib(zeroed)}")
    print("  entries: " + ", ".join(f"{k} {mib(v)}" for k, v in sorted(seen.items())))


if __name__ == "__main__":
    main()
