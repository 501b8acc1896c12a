"""SGLang's PD control frames, built on the generated ``pdwire.wire.sglang``: :mod:`.convert`,
the conversions between SGLang's messages and pdwire's newest model (the profile's cross-frame
rules are :mod:`pdwire.wirehooks.sglang_rules`; ``pdwire inspect`` is :mod:`pdwire.protocols.inspect`)."""
