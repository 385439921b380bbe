"""training.mixed_precision=auto and everything that follows it: the resolver on faked CPU flags
and a faked CUDA device, the run header's reason, and Muon's Newton-Schulz dtype."""

from __future__ import annotations

import os

import pytest
import torch

from titan_hydra import hardware
from titan_hydra.hardware import cpu_flags, cpu_isa, resolve_precision
from titan_hydra.train import muon


@pytest.fixture(autouse=True)
def uncapped_onednn(monkeypatch):
    """The tests fake this CPU's flags; an ISA cap in the environment (ONEDNN_MAX_CPU_ISA=AVX2,
    e.g. to reproduce an AVX2-only machine) would override them."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)


AVX2 = frozenset("fpu sse2 avx avx2 fma".split())
AVX512_BF16 = frozenset("fpu avx2 avx512f avx512_bf16".split())
AMX = frozenset("fpu avx2 avx512f amx_tile amx_bf16".split())
GRAVITON3 = frozenset("fp asimd sve bf16 i8mm".split())


@pytest.mark.parametrize("flags,want,isa", [
    (AVX2, "fp32", "AVX2"),
    (AVX512_BF16, "bf16", "AVX512-BF16"),
    (AMX, "bf16", "AMX-BF16"),
    (GRAVITON3, "bf16", "Arm BF16"),
    (frozenset(), "fp32", "unknown ISA"),
])
def test_auto_on_a_cpu_follows_its_flags(flags, want, isa):
    got = resolve_precision("auto", "cpu", flags=flags)
    assert got.value == want and cpu_isa(flags) == isa
    if want == "fp32":
        assert got.reason == "auto: this CPU has no native bf16 matmuls"
    else:
        assert got.reason == f"auto: this CPU has native bf16 matmuls ({isa})"


def test_auto_on_cuda_follows_the_gpu(monkeypatch):
    assert resolve_precision("auto", "cuda", cuda_bf16=True) == ("bf16", "auto: this GPU computes bf16 natively")
    assert resolve_precision("auto", "cuda", cuda_bf16=False).value == "fp32"  # V100, T4
    # a faked device: what torch reports decides
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_precision("auto", "cuda").value == "fp32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_precision("auto", "cuda").value == "bf16"
    # planning a GPU run from a machine without one: bf16, what every GPU it plans for has
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_precision("auto", "cuda").value == "bf16"


def test_explicit_choices_win_over_the_hardware():
    for device in ("cpu", "cuda"):
        assert resolve_precision("bf16", device, flags=AVX2, cuda_bf16=False) == ("bf16", "set explicitly")
        assert resolve_precision("fp32", device, flags=AMX, cuda_bf16=True) == ("fp32", "set explicitly")
    with pytest.raises(ValueError, match="not one of auto, bf16, fp32"):
        resolve_precision("fp16", "cpu")


def test_cpu_flags_read_x86_and_arm_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\nCPU implementer\t: 0x41\n")
    assert cpu_flags(str(x86)) == {"fpu", "avx2", "fma"} and hardware.cpu_model(str(x86)) == "AMD EPYC"
    assert "bf16" in cpu_flags(str(arm))
    assert cpu_flags(str(tmp_path / "missing")) is None


def test_the_config_default_is_auto_and_resolves_per_device(compose_config, monkeypatch):
    from titan_hydra.config import mixed_precision_of, precision_choice_of

    monkeypatch.setattr(hardware, "_this_cpu_flags", lambda: AVX2)
    cfg = compose_config([])
    assert str(cfg.training.mixed_precision) == "auto"
    assert precision_choice_of(cfg) == ("fp32", "auto: this CPU has no native bf16 matmuls")
    monkeypatch.setattr(hardware, "_this_cpu_flags", lambda: AMX)
    assert mixed_precision_of(cfg) == "bf16"
    assert mixed_precision_of(compose_config(["training.mixed_precision=fp32"])) == "fp32"
    # the experiment recipes follow the hardware too
    for exp in ("llama_100m", "muon_vs_adamw"):
        assert str(compose_config([f"experiment={exp}"]).training.mixed_precision) == "auto", exp


def test_muon_newton_schulz_dtype_follows_the_hardware(compose_config, monkeypatch):
    cfg = compose_config(["optimizer=muon"])
    assert cfg.optimizer.param_groups[0].ns_dtype == "auto"
    monkeypatch.setattr(hardware, "_this_cpu_flags", lambda: AVX2)
    assert muon.ns_dtype_of("auto", torch.device("cpu")) == torch.float32
    monkeypatch.setattr(hardware, "_this_cpu_flags", lambda: AVX512_BF16)
    assert muon.ns_dtype_of("auto", torch.device("cpu")) == torch.bfloat16
    assert muon.ns_dtype_of("float32", torch.device("cpu")) == torch.float32  # explicit wins

    # the step really runs in that dtype: auto equals the explicit choice it resolves to, bit for bit
    def stepped(ns_dtype):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(16, 8))
        p.grad = torch.randn(16, 8)
        muon.Muon([p], lr=0.02, ns_dtype=ns_dtype).step()
        return p.detach()

    monkeypatch.setattr(hardware, "_this_cpu_flags", lambda: AVX2)
    assert torch.equal(stepped("auto"), stepped("float32"))
    assert not torch.equal(stepped("auto"), stepped("bfloat16"))
    monkeypatch.setattr(hardware, "_this_cpu_flags", lambda: AMX)
    assert torch.equal(stepped("auto"), stepped("bfloat16"))


def test_onednn_isa_cap_below_bf16_turns_auto_to_fp32(monkeypatch):
    """ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN emulate bf16 on any CPU: auto follows the cap, not the flags."""
    monkeypatch.setattr(hardware, "_this_cpu_flags", lambda: AVX512_BF16)
    assert resolve_precision("auto", "cpu").value == "bf16"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    assert resolve_precision("auto", "cpu") == ("fp32", "auto: oneDNN is capped below bf16 (ONEDNN_MAX_CPU_ISA=AVX2)")
    assert "ONEDNN_MAX_CPU_ISA=avx2" in hardware.isa_env_key()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")  # a cap that keeps bf16
    assert resolve_precision("auto", "cpu").value == "bf16"


def test_inductor_cache_is_separate_under_an_aten_capability_override(monkeypatch, tmp_path):
    """A capped run (ATEN_CPU_CAPABILITY) gets its own inductor cache: inductor's graph cache does not
    key on the vector width, so sharing one with an uncapped run corrupts the heap."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = os.path.abspath(default_cache_dir())
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert hardware.inductor_cache_for_isa() is None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "AVX2")
    assert hardware.inductor_cache_for_isa() == default + "_avx2"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == default + "_avx2"

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default)  # what inductor writes back once it ran
    assert hardware.inductor_cache_for_isa() == default + "_avx2"

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the user's own choice stays
    assert hardware.inductor_cache_for_isa() is None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)
