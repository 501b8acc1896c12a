"""Hand-written support library of the generated codecs (``pdwire.wire``).

Pure and protocol-agnostic apart from :mod:`.migrations`: errors, the fixed header frame,
packed-array helpers, msgspec error translation and version agreement.
"""
