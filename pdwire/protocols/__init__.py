"""Hand-written code that belongs to one protocol, next to it: ``pdwire.protocols.<protocol>``.

* :mod:`pdwire.protocols.pdwire`: the migrations between versions of pdwire's own protocol;
* :mod:`pdwire.protocols.sglang`: SGLang's cross-frame rules, the conversions between SGLang's
  messages and pdwire's, and ``pdwire inspect``.

Each is written against the newest model (``pdwire.wire`` and ``pdwire.wire.sglang``), so a
schema bump that renames or retypes something it uses fails its type check and tests here,
instead of leaving it on an old version.
"""
