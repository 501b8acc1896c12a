"""pdwire: a versioned, generated control protocol and transfer runtime for PD-disaggregated serving.

Sub-packages:
    pdwire.wire      generated codecs (from schema/ by codegen/), do not edit by hand
    pdwire.codegen   the schema loader, evolution checks and code generator
    pdwire.runtime   planner, transfer backends, control plane and sessions
"""

__version__ = "0.1.0"
