"""SGLang 0.5.23 loads the pdwire backend through its own plugin mechanism.

Run in a fresh interpreter: SGLang's schedulers import ``get_kv_class`` from
``sglang.srt.disaggregation.utils`` at module level (``from ... import get_kv_class``), so the
check that matters is that those already-imported bindings in prefill.py and decode.py answer
pdwire's classes after ``load_plugins()``, exactly as in a scheduler process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, warnings
    warnings.filterwarnings("ignore")
    # the schedulers' modules first, holding their own `get_kv_class` bindings
    import sglang.srt.disaggregation.decode as decode
    import sglang.srt.disaggregation.prefill as prefill
    import sglang.srt.managers.disagg_service as disagg_service
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    import os
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    before = "pdwire" in [b.value for b in TransferBackend]
    os.environ["SGLANG_PLUGINS"] = "some-other-plugin"  # SGLang's filter by entry-point name
    filtered = sorted(load_plugins_by_group(GENERAL_PLUGINS_GROUP))
    os.environ["SGLANG_PLUGINS"] = "pdwire"
    selected = sorted(load_plugins_by_group(GENERAL_PLUGINS_GROUP))
    load_plugins()
    from pdwire.integrations.sglang import conn

    out = {"before": before, "filtered": filtered, "selected": selected}
    pd = TransferBackend("pdwire")
    out["member"] = [pd.name, pd is TransferBackend.PDWIRE, len(TransferBackend)]
    for name, mod in (("prefill", prefill), ("decode", decode), ("service", disagg_service)):
        out[name] = {
            t.name: getattr(mod.get_kv_class(pd, t), "__qualname__", None) for t in KVClassType
        }
    nixl = TransferBackend("nixl")
    out["nixl"] = {t.name: getattr(prefill.get_kv_class(nixl, t), "__qualname__", None) for t in KVClassType}
    out["server_is_common"] = disagg_service.rust_server_serves_kv_bootstrap("pdwire")
    args = prepare_server_args([
        "--model-path", "dummy", "--disaggregation-mode", "prefill",
        "--disaggregation-transfer-backend", "pdwire",
    ])
    out["parsed"] = args.disaggregation_transfer_backend
    load_plugins()  # idempotent: a second call adds nothing
    out["members_after_second_load"] = len(TransferBackend)
    try:
        prepare_server_args(["--model-path", "dummy", "--disaggregation-transfer-backend", "nope"])
        out["bad"] = "accepted"
    except SystemExit as exc:
        out["bad"] = f"exit {exc.code}"
    print("RESULT " + json.dumps(out))
    """
)


def _run(env_extra: dict[str, str]) -> dict[str, object]:
    env = dict(os.environ, **env_extra)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env, check=False
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result: dict[str, object] = json.loads(lines[-1][len("RESULT ") :])
    return result


def test_load_plugins_registers_pdwire_for_the_schedulers() -> None:
    out = _run({"SGLANG_PLUGINS": "pdwire"})
    assert out["before"] is False
    assert out["filtered"] == [] and out["selected"] == ["pdwire"]
    assert out["member"][0] == "PDWIRE" and out["member"][1] is True  # type: ignore[index]
    want = {
        "KVARGS": "KVArgs",
        "MANAGER": "PdwireKVManager",
        "SENDER": "PdwireKVSender",
        "RECEIVER": "PdwireKVReceiver",
        "BOOTSTRAP_SERVER": "PdwireKVBootstrapServer",
    }
    for module in ("prefill", "decode", "service"):
        assert out[module] == want, module
    assert out["nixl"] == {
        "KVARGS": "KVArgs",
        "MANAGER": "NixlKVManager",
        "SENDER": "NixlKVSender",
        "RECEIVER": "NixlKVReceiver",
        "BOOTSTRAP_SERVER": "NixlKVBootstrapServer",
    }
    # SGLang's Rust server may stand in for the bootstrap server: it is SGLang's own
    assert out["server_is_common"] is True
    assert out["parsed"] == "pdwire"
    assert out["members_after_second_load"] == out["member"][2]  # type: ignore[index]
    assert out["bad"] == "exit 2"
