"""The envelope layout (pdwire's own protocols): a 12-byte header frame, a msgpack body whose
positions are field ids, large arrays as side frames.

:mod:`.header` (the header frame), :mod:`.codec` (what generated major modules declare, the
registry that encodes, decodes and down-converts), :mod:`.msgspec_errors` (msgspec's decode
errors as typed ones naming the field), :mod:`.negotiate` (the Hello version agreement).
"""
