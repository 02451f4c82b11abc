"""The one compiled part of peerd: tp_agree's round on the control page (peerd/_pagevote.c).

Everything else is in pyproject.toml. The extension is optional: where no C
compiler is found the install goes on, and groups agree through the daemon's
messages (peerd.pageagree says so once, with the reason)."""

from setuptools import Extension, setup

setup(
    ext_modules=[Extension("peerd._pagevote", ["peerd/_pagevote.c"], py_limited_api=True, optional=True,
                           extra_compile_args=["-O2", "-std=gnu11"])],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
