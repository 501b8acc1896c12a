"""SGLang 0.5.23's real classes, from SGLang's own venv (./dev setup_sglang).

SGLang imports torchvision at module level (image processing); PyPI's build cannot load beside
the CPU torch, so ``stubs/`` (a torchvision whose every call raises) goes first on ``sys.path``
here and on ``PYTHONPATH`` for the processes the tests start. Nothing of it is installed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

STUBS = Path(__file__).resolve().parent / "stubs"

if str(STUBS) not in sys.path:
    sys.path.insert(0, str(STUBS))
# nothing here may reach a model hub (this machine has no network beyond the registries)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# pdwire's prefill sockets bind the address SGLang's get_local_ip_auto picks
os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
_pp = os.environ.get("PYTHONPATH", "")
if str(STUBS) not in _pp.split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(STUBS), _pp) if p)
