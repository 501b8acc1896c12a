"""SGLang's PD control frames: the hand-written parts next to the generated ``pdwire.wire.sglang``.

* :mod:`.rules`: cross-frame checks and derived properties ``schema/sglang.yaml`` names;
* :mod:`.convert`: conversions between SGLang's messages and pdwire's newest model;
* :mod:`.inspect`: ``pdwire inspect``, decoding a captured message.
"""
