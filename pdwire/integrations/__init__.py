"""Engine integrations built on pdwire's engine-facing runtime API."""
