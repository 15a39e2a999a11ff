"""The vLLM pack for the device machine, checked without building it: `device_run.sh --vllm` (dry) puts the unpacked
pack ahead of site-packages and works offline, tools/pack_vllm.sh downloads exact versions only (agreeing with vLLM
0.33's own requirements where vLLM is installed), and every shim of tools/vllm_device_shims.py says what it hides.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")


def _pins() -> dict[str, str]:
    text = (TOOLS / "pack_vllm.sh").read_text()
    block = re.search(r'^PINS="([^"]*)"', text, re.M)
    assert block, "pack_vllm.sh has no PINS"
    pins = {}
    for token in block.group(1).split():
        name, sep, version = token.partition("==")
        assert sep and re.fullmatch(r"[A-Za-z0-9.]+", version), f"{token!r} is not an exact pin"
        pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


@needs_bash
def test_dry_vllm_step_puts_the_pack_ahead_of_site_packages(tmp_path):
    env = {**os.environ, "DRY": "1", "OUT": str(tmp_path)}
    done = subprocess.run(["bash", "tools/device_run.sh", "--vllm", "tests", "tests/test_vllm_gpu.py"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    unpack, path, test = done.stdout.strip().splitlines()
    assert ".carry/vllm/vllm_site.tar.xz" in unpack and "vllm_so.tar.xz" in unpack and "/tmp/vllm_site" in unpack
    # the shims' child-process hook (tools/device_boot/sitecustomize.py) right after the pack
    assert path.startswith(f"PYTHONPATH=/tmp/vllm_site:{ROOT}/tools/device_boot:{ROOT} ")
    assert all(f"{var}=1" in path for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS"))
    assert test.startswith("python3 -m pytest") and test.endswith("tests/test_vllm_gpu.py")


@needs_bash
def test_pack_script_parses_and_pins_exact_versions():
    assert subprocess.run(["bash", "-n", str(TOOLS / "pack_vllm.sh")]).returncode == 0
    pins = _pins()
    assert pins["vllm"] == "0.33.0"
    text = (TOOLS / "pack_vllm.sh").read_text()
    assert ".carry/vllm" in text and "vllm_site.tar.xz" in text and "vllm_so.tar.xz" in text


def test_pins_satisfy_vllms_own_requirements():
    """Where vLLM 0.33 is installed (CI's venv), each pinned package meets vLLM's Requires-Dist for it."""
    from importlib import metadata

    try:
        requires = metadata.requires("vllm") or []
    except metadata.PackageNotFoundError:
        pytest.skip("vLLM is not installed here")
    Requirement = pytest.importorskip("packaging.requirements").Requirement
    pins, checked = _pins(), 0
    for line in requires:
        req = Requirement(line)
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name in pins and (req.marker is None or req.marker.evaluate({"python_version": "3.12", "extra": ""})):
            assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} vs vLLM's {req}"
            checked += 1
    assert checked >= 10


def test_every_shim_says_what_it_hides():
    spec = importlib.util.spec_from_file_location("vllm_device_shims", TOOLS / "vllm_device_shims.py")
    shims = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shims)  # loading it imports no vLLM: install() does the work
    assert shims.SHIMS and not shims.REPORT
    for shim in shims.SHIMS:
        doc = shim.__doc__ or ""
        assert "Why:" in doc and "Hides:" in doc, f"{shim.__name__} does not say why it exists and what it hides"
