"""The demo: a small hybrid model's caches in rank processes, moved and verified byte for byte.

Built on the runtime's public API like any engine integration; nothing in the runtime imports
it. ``pdwire demo`` is :mod:`.cli`; the rank processes are :mod:`.rank`, driven by
:mod:`.cluster`; the model's layout is :mod:`.model` and its deterministic content
:mod:`.content` (both need torch); :mod:`.serve_mode` runs the scenario through ``pdwire serve``.
"""


def register_mori_fake() -> None:
    """Make backend ``mori-fake`` (the MoRI adapter over :mod:`.mori_fake`, an in-process fake of
    MoRI's IO engine) known to the registry. Called where a backend is picked (the command, each
    rank process, ``pdwire serve``, the backend suites), never as a side effect of an import."""
    from pdwire.runtime.backends.registry import register_backend

    register_backend("mori-fake", "pdwire.demo.mori_fake", "MoriFakeBackend")
