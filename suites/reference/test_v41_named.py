"""DeepSeek-V4.1 is named as V4.1, never misread as V4 nor dismissed as "not DeepSeek-V4": a different architecture
under similar names (nested text and vision configs, Engram and DSpark, other shapes for the same five projections).

The input is a tiny V4.1-shaped base written from the published facts (``tiny_models/v41.py``), in each known
spelling. Every command given it says first, in one line, that it is DeepSeek-V4.1, not supported yet and why, and
exits 1 without a traceback.
"""

from __future__ import annotations

import sys

import pytest

from fixtures.runner.subproc import run
from tiny_models.v41 import V41_SPELLINGS, write_v41_base

pytestmark = pytest.mark.cpu

SPELLINGS = pytest.mark.parametrize("arch,model_type", V41_SPELLINGS, ids=[a for a, _ in V41_SPELLINGS])
#: what the one line must say: the name, that it is another architecture and unsupported, and a difference
SAID = ("DeepSeek-V4.1", "different architecture", "not supported yet", "text_config")


def _says_v41(text: str, what: str) -> None:
    missing = [s for s in SAID if s not in text]
    assert not missing, f"{what} does not say {missing}:\n{text[-2000:]}"


@SPELLINGS
def test_the_detector_names_v41_in_every_spelling(impl, tmp_path, arch, model_type):
    import json

    base = write_v41_base(tmp_path / "v41", arch, model_type)
    config = json.loads((base / "config.json").read_text())
    assert impl.is_deepseek_v41_config(config) and not impl.is_deepseek_v4_config(config), config
    with pytest.raises(impl.DeepseekV41UnsupportedError) as err:
        impl.require_deepseek_v4_config(config)
    _says_v41(str(err.value), "require_deepseek_v4_config")
    assert isinstance(err.value, impl.NotDeepseekV4Error), "a V4.1 config must still be refused as not V4"
    # only the nested text config names it: the detector looks there too
    nested = {"architectures": None, "text_config": {"model_type": model_type}}
    assert impl.is_deepseek_v41_config(nested), nested


@SPELLINGS
def test_reading_a_v41_base_names_it_first(impl, tmp_path, arch, model_type):
    base = write_v41_base(tmp_path / "v41", arch, model_type)
    read = impl.inspect_base(base)
    assert read.problems, "a V4.1 base read as a V4 base without a problem"
    first = read.problems[0]
    assert first.error is impl.DeepseekV41UnsupportedError, f"first problem {first}"
    _says_v41(first.message, "inspect_base's first problem")


def test_v4_and_other_models_are_not_called_v41(impl):
    for config in (
        {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"},
        {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"},
        {"architectures": ["DeepseekV41ForCausalLMX"], "model_type": "deepseek_v4"},
        {},
    ):
        assert not impl.is_deepseek_v41_config(config), config


@pytest.mark.slow
@pytest.mark.parametrize("command", ["coverage", "verify-adapter", "qualify"])
def test_every_command_given_a_v41_base_says_so_in_one_line_and_exits_1(impl, tmp_path, command):
    arch, model_type = V41_SPELLINGS[0]
    base = write_v41_base(tmp_path / "v41", arch, model_type)
    args = {
        "coverage": ["--base", base],
        "verify-adapter": ["--base", base, "--adapter", tmp_path / "no-adapter"],
        "qualify": ["--base", base, "--out", tmp_path / "out"],
    }[command]
    result = run([sys.executable, "-m", f"{impl.name}.cli", command, *map(str, args)], timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 1, f"{command} exited {result.returncode}:\n{out[-3000:]}"
    assert "Traceback" not in out, f"{command} printed a traceback:\n{out[-3000:]}"
    lines = [line for line in out.splitlines() if "DeepSeek-V4.1" in line]
    assert lines, f"{command} never names DeepSeek-V4.1:\n{out[-3000:]}"
    _says_v41(lines[0], f"{command}'s first V4.1 line")
