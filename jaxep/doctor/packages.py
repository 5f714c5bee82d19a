"""What is installed, as the doctor reads it: the wheels and their CUDA majors (nvidia-nvshmem-cuNN,
jax-cudaNN-plugin, the extension's build, the driver) and whether they agree, and the libraries a
shared object links (its ELF DT_NEEDED entries)."""
from __future__ import annotations

import importlib.metadata
import re
import struct


def _so_major(name):
    m = re.search(r"\.so\.(\d+)", name)
    return int(m.group(1)) if m else None


def elf_needed(path) -> list[str] | None:
    """The DT_NEEDED entries of an ELF64 file (the libraries the dynamic loader loads for it), read
    from its program headers as the loader does; None when `path` is not a readable ELF64 file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    # ELF64 only (jaxep builds for x86-64 and aarch64 Linux); data[5] is the byte order.
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] not in (1, 2):
        return None
    e = "<" if data[5] == 1 else ">"
    try:
        phoff, = struct.unpack_from(e + "Q", data, 0x20)             # e_phoff
        phentsize, phnum = struct.unpack_from(e + "HH", data, 0x36)  # e_phentsize, e_phnum
        # Elf64_Phdr: p_type, p_flags, p_offset, p_vaddr, p_paddr, p_filesz (then p_memsz, p_align)
        phdrs = [struct.unpack_from(e + "IIQQQQ", data, phoff + i * phentsize) for i in range(phnum)]
        segs = [(h[0], h[2], h[3], h[5]) for h in phdrs]
        dyn_fmt = e + "qQ"  # Elf64_Dyn: d_tag, d_val
        # segs: (p_type, file offset, virtual address, size in the file); PT_LOAD 1, PT_DYNAMIC 2
        dyn = [s for s in segs if s[0] == 2]
        if not dyn:
            return []  # statically linked: needs nothing
        _, off, _, size = dyn[0]
        needed, strtab, step = [], None, struct.calcsize(dyn_fmt)
        for pos in range(off, off + size - step + 1, step):
            tag, val = struct.unpack_from(dyn_fmt, data, pos)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED: an offset into the string table
                needed.append(val)
            elif tag == 5:  # DT_STRTAB: the string table's virtual address
                strtab = val
        if strtab is None:
            return None
        # The string table's file offset, through the PT_LOAD segment that maps its address.
        base = next((o + strtab - v for t, o, v, n in segs if t == 1 and v <= strtab < v + n), None)
        if base is None:
            return None
        return [data[base + n:data.index(b"\0", base + n)].decode(errors="replace") for n in needed]
    except (struct.error, ValueError):
        return None


_NVSHMEM_WHEEL = re.compile(r"nvidia-nvshmem-cu(\d+)$")
_JAX_PLUGIN = re.compile(r"jax-cuda(\d+)-plugin$")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_distributions() -> list[str]:
    """The names of every installed distribution (importlib.metadata), normalised (PEP 503)."""
    names = set()
    for d in importlib.metadata.distributions():
        name = d.metadata.get("Name") if d.metadata else None
        if name:
            names.add(_norm(name))
    return sorted(names)


def cuda_majors(dists, extension_cuda_major=None, driver_cuda_version=None) -> dict:
    """The CUDA majors of what is installed: the nvidia-nvshmem-cuNN wheels, the jax-cudaNN-plugin
    distributions (names in `dists`), the extension's build and the driver ("13.0")."""
    names = {_norm(d) for d in dists}

    def majors(pattern):
        return sorted(int(m.group(1)) for m in map(pattern.match, names) if m)

    m = re.match(r"(\d+)", driver_cuda_version or "")
    return {"nvshmem_wheels": majors(_NVSHMEM_WHEEL), "jax_plugins": majors(_JAX_PLUGIN),
            "extension": extension_cuda_major, "driver": int(m.group(1)) if m else None}


def cuda_problems(c) -> list[tuple[str, str, str]]:
    """(level, what, hint) for every CUDA-major mismatch in cuda_majors()'s dict `c`."""
    out = []
    shm, plugins, ext, drv = c["nvshmem_wheels"], c["jax_plugins"], c["extension"], c["driver"]
    # The major everything should agree on: the extension's, else jax's plugin's.
    want = ext if ext is not None else (plugins[0] if len(plugins) == 1 else None)
    basis = "the jaxep extension's build" if ext is not None else f"jax-cuda{want}-plugin"
    wheels = " ".join(f"nvidia-nvshmem-cu{m}" for m in shm)
    if len(shm) > 1:
        out.append(("error", f"{' and '.join(wheels.split())} are all installed: they write the "
                    "same files under nvidia/nvshmem/ (the last one installed won), and uninstalling "
                    "one deletes files the other needs",
                    f"pip uninstall -y {wheels} && pip install nvidia-nvshmem-cu{want} (CUDA {want}, "
                    f"as {basis})" if want is not None else
                    f"pip uninstall -y {wheels}, then install only the one of your CUDA major "
                    "(nvidia-nvshmem-cu13 or -cu12)"))
    if ext is not None and shm and ext not in shm:
        out.append(("error", f"the jaxep extension was built for CUDA {ext}, the installed NVSHMEM "
                    f"wheel is {wheels}",
                    f"pip uninstall -y {wheels} && pip install nvidia-nvshmem-cu{ext}, or rebuild "
                    f"jaxep with the CUDA {shm[0]} toolkit (docs/build.md)"))
    if ext is not None and plugins and ext not in plugins:
        got = " ".join(f"jax-cuda{m}-plugin" for m in plugins)
        out.append(("error", f"the jaxep extension was built for CUDA {ext}, jax's CUDA plugin is "
                    f"{got}",
                    f"pip install 'jax[cuda{ext}]' (after pip uninstall -y {got}), or rebuild jaxep "
                    f"with the CUDA {plugins[0]} toolkit (docs/build.md)"))
    if len(plugins) > 1:
        got = " ".join(f"jax-cuda{m}-plugin" for m in plugins)
        out.append(("warn", f"{got} are all installed; jax loads one of them",
                    f"pip uninstall the ones not of CUDA {want if want is not None else drv}"))
    if ext is None and len(shm) == 1 and len(plugins) == 1 and shm != plugins:
        out.append(("warn", f"{wheels} is installed with jax-cuda{plugins[0]}-plugin: a jaxep build "
                    f"here would link CUDA {shm[0]}'s NVSHMEM into a CUDA {plugins[0]} JAX",
                    f"pip uninstall -y {wheels} && pip install nvidia-nvshmem-cu{plugins[0]}"))
    if ext is not None and drv is not None and drv < ext:
        out.append(("error", f"the jaxep extension was built for CUDA {ext}, the driver supports "
                    f"CUDA {drv}", f"update the NVIDIA driver, or rebuild jaxep with CUDA {drv}"))
    return out
