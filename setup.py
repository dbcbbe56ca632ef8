"""Build of the optional C ring loop (transport/ringloop/); everything else is in pyproject.toml.

The extension is optional: where no C compiler is present the install still succeeds and the
ring runs its Python loop (see docs/transport.md)."""

from setuptools import Extension, setup

RINGLOOP = ["transport/ringloop/module.c", "transport/ringloop/recv.c", "transport/ringloop/send.c"]

setup(ext_modules=[Extension("p2pft.transport._ringloop", RINGLOOP, depends=["transport/ringloop/ringloop.h"],
                             optional=True, extra_compile_args=["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter"])])
