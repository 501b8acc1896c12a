"""The hand-written functions generated codecs call, one module per protocol: a leaf below the
wire (``pdwire.wire``), importing only :mod:`pdwire.wirecore`, so the generated code and its
hooks form no cycle with the code built on the wire (:mod:`pdwire.protocols`).

* :mod:`.migrations`: the steps between minors of pdwire's protocol (``schema/pdwire.yaml``,
  ``migrations:``);
* :mod:`.sglang_rules`: the cross-frame checks and derived properties of SGLang's frames
  (``schema/sglang.yaml``, ``rules:``).
"""
