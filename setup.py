"""The one compiled part of pdwire: the flat-message encoder's fast path (pdwire/wirecore/_flatenc.c).

Everything else is declared in pyproject.toml. The extension is optional: where it cannot be
built (no C compiler), pdwire installs without it and encodes with the generated Python
encoders, which it always keeps as the fallback (tests/wire/test_flat_encoder.py checks that
this machine built it, and that both write the same bytes).
"""

import numpy
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pdwire.wirecore._flatenc",
            ["pdwire/wirecore/_flatenc.c"],
            include_dirs=[numpy.get_include()],
            optional=True,
        )
    ]
)
