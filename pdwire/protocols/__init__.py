"""Hand-written tools built on the generated wire: :mod:`pdwire.protocols.sglang` (conversions
between SGLang's messages and pdwire's newest model) and :mod:`.inspect` (``pdwire inspect``).

Each is written against the newest model (``pdwire.wire`` and ``pdwire.wire.sglang``), so a
schema bump that renames or retypes something it uses fails its type check and tests here,
instead of leaving it on an old version. The functions the generated code itself calls
(migrations, SGLang's rules) live below the wire, in :mod:`pdwire.wirehooks`.
"""
