"""Build glue that pyproject.toml cannot express: the package-dir mapping of the top-level folders
into the one ``basertd`` namespace, the cffi API-mode ring atomics, the tick header's declarations as
cffi out-of-line ABI-mode modules (``native/build_tick_ffi.py``), and the C reference engine as a
plain shared library (``basertd/native/libbasert_ref.so``) loaded with ``dlopen`` like libbaseRT."""

from __future__ import annotations

import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# Top-level folder -> import package (DESIGN.md "Layout").
FOLDERS = {
    "basertd": "basertd",
    "basertd.schema": "schema",
    "basertd.shm": "shm",
    "basertd.worker": "worker",
    "basertd.native": "native",
}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    for pkg, folder in FOLDERS.items():
        for root, dirs, files in os.walk(folder):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__")) and d != "build"]
            if "__init__.py" not in files:
                continue
            rel = os.path.relpath(root, folder)
            name = pkg if rel == "." else pkg + "." + rel.replace(os.sep, ".")
            packages.append(name)
            package_dir[name] = root
    return packages, package_dir


class SharedLibBuild(build_ext):
    """Names the reference engine ``libbasert_ref.so`` (no Python ABI tag): it is an engine library,
    not an extension module, and is opened by path through ``cffi.FFI.dlopen``."""

    PLAIN = {"basertd.native.libbasert_ref"}

    def get_ext_filename(self, fullname: str) -> str:
        # distutils' get_ext_fullpath asks with the last name component only, the in-place copy
        # with the full dotted name: both must get the plain ".so" name, or the copy looks for a
        # file the link step never wrote.
        if fullname in self.PLAIN or fullname in {n.rsplit(".", 1)[-1] for n in self.PLAIN}:
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)

    def get_export_symbols(self, ext: Extension) -> list[str]:
        if ext.name in self.PLAIN:
            return []
        return super().get_export_symbols(ext)


_CFLAGS = [
    "-O2",
    "-std=c11",
    "-Wall",
    "-Wextra",
    "-Werror=implicit-function-declaration",
    "-fvisibility=default",
]


def _ref_engine() -> list[Extension]:
    src_dir = os.path.join("native", "ref_engine")
    if not os.path.isdir(src_dir):
        return []
    sources = sorted(os.path.join(src_dir, f) for f in os.listdir(src_dir) if f.endswith(".c"))
    if not sources:
        return []
    return [
        Extension(
            "basertd.native.libbasert_ref",
            sources=[*sources, os.path.join("native", "brt_ring.c")],
            include_dirs=["native", src_dir],
            extra_compile_args=_CFLAGS + os.environ.get("BASERT_REF_CFLAGS", "").split(),
            extra_link_args=["-ldl", *os.environ.get("BASERT_REF_LDFLAGS", "").split()],
        )
    ]


def _cffi_modules() -> list[str]:
    mods = []
    if os.path.exists(os.path.join("native", "build_ring_ffi.py")):
        mods.append("native/build_ring_ffi.py:ffibuilder")
    if os.path.exists(os.path.join("native", "build_tick_ffi.py")):
        # The tick header's declarations as out-of-line ABI-mode modules (no pycparser at run time).
        variants = ("tick", "tick_ref", "tick_basert", "tick_basert_ref")
        mods += [f"native/build_tick_ffi.py:{v}" for v in variants]
    return mods


packages, package_dir = _packages()
# The reference engine's header is read at run time (basertd.native.ref cdefs it), so its folder
# ships as a data-only package.
packages.append("basertd.native.ref_engine")
package_dir["basertd.native.ref_engine"] = os.path.join("native", "ref_engine")
setup(
    packages=packages,
    package_dir=package_dir,
    package_data={
        "basertd.native": ["*.h"],
        "basertd.native.ref_engine": ["*.h"],
        "basertd.server.transport.http.chat_templates": ["*.jinja"],
        "basertd.server.transport.http.static": ["*.html", "*.js", "*.css"],
    },
    ext_modules=_ref_engine(),
    cffi_modules=_cffi_modules(),
    cmdclass={"build_ext": SharedLibBuild},
)
