"""The demo: a small hybrid model's caches in rank processes, moved and verified byte for byte.

Built on the runtime's public API like any engine integration; nothing in the runtime imports
it. Importing this package registers the demo's ``mori-fake`` backend (the MoRI adapter over an
in-process fake of MoRI's IO engine) with the backend registry. ``pdwire demo`` is
:mod:`.cli`; the rank processes are :mod:`.rank`, driven by :mod:`.cluster`; the model's layout
is :mod:`.model` and its deterministic content :mod:`.content` (both need torch).
"""

from pdwire.runtime.backends.registry import register_backend

register_backend("mori-fake", "pdwire.runtime.demo.mori_fake", "MoriFakeBackend")
