"""Hypothesis profiles: "ci" (default, bounded run time); "dev" (HYPOTHESIS_PROFILE=dev) runs many more."""

import importlib.util
import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile(
    "dev", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Each integration's tests live in one folder (tests/vllm, tests/sglang); the part that runs the
# real engine lives in a sub-folder run from that engine's venv by scripts/check.sh.
# tests/vllm/engines needs vLLM's CPU build (./dev setup_vllm); any other venv leaves that
# folder out rather than failing to import.
collect_ignore: list[str] = []
try:
    import vllm  # noqa: F401
except ImportError:
    collect_ignore.append("vllm/engines")

# tests/sglang/backend likewise needs SGLang 0.5.23 from its own venv (./dev setup_sglang);
# looked up without importing it (SGLang imports torch, triton and transformers at start-up).
if importlib.util.find_spec("sglang") is None:
    collect_ignore.append("sglang/backend")

# The control plane is authenticated (CURVE) by default and a worker without keys refuses to
# start. The suite runs it unauthenticated unless a test gives keys (tests/e2e/test_control_auth.py
# runs the authenticated path on real sockets); child processes inherit the setting.
os.environ.setdefault("PDWIRE_INSECURE_CONTROL", "1")
