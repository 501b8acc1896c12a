"""pdwire as an SGLang transfer backend (``--disaggregation-transfer-backend pdwire``)."""
