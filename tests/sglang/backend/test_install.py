"""The SGLang venv is what the set-up promises: SGLang 0.5.23 on the CPU build of torch 2.13.0."""

from __future__ import annotations

import importlib.metadata


def test_sglang_0_5_23_on_cpu_torch() -> None:
    import sglang
    import torch

    assert importlib.metadata.version("sglang") == "0.5.23"
    assert torch.__version__ == "2.13.0+cpu"
    assert not torch.cuda.is_available()
    assert sglang.__file__ is not None


def test_torchvision_is_the_test_stub() -> None:
    import torchvision
    import torchvision.transforms.functional as F

    assert torchvision.__version__.endswith("+stub")
    try:
        F.pil_to_tensor(None)
    except NotImplementedError as exc:
        assert "pil_to_tensor" in str(exc)
    else:
        raise AssertionError("the stub must refuse every call")


def test_disaggregation_modules_import() -> None:
    import sglang.srt.disaggregation.common.conn as common
    import sglang.srt.disaggregation.decode as decode
    import sglang.srt.disaggregation.fake as fake
    import sglang.srt.disaggregation.nixl as nixl
    import sglang.srt.disaggregation.prefill as prefill

    assert issubclass(nixl.NixlKVManager, common.CommonKVManager)
    assert fake.FakeKVSender and prefill.get_kv_class is decode.get_kv_class
