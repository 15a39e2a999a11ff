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
import sys
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


@needs_bash
def test_dry_vllm_step_takes_another_pack(tmp_path):
    """--vllm DIR (DIR holding a vllm_site.tar.xz) and --vllm=DIR unpack that pack instead of .carry/vllm."""
    pack = tmp_path / "vllm_flashmla"
    pack.mkdir()
    (pack / "vllm_site.tar.xz").write_bytes(b"")
    env = {**os.environ, "DRY": "1", "OUT": str(tmp_path / "out")}
    for args in (["--vllm", str(pack)], [f"--vllm={pack}"]):
        done = subprocess.run(["bash", "tools/device_run.sh", *args, "suite", "--quick"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        unpack, path, suite = done.stdout.strip().splitlines()
        assert f"{pack}/vllm_site.tar.xz" in unpack and ".carry/vllm/" not in unpack
        assert path.startswith("PYTHONPATH=/tmp/vllm_site:")
        assert "python3 -m vllm_kimi_dsa bench" in suite and suite.endswith("--quick")


@needs_bash
@pytest.mark.skipif(shutil.which("xz") is None, reason="no xz on this machine")
def test_pack_from_another_pack_cuts_the_libraries_to_flashmla(tmp_path):
    """SO=flashmla FROM=DIR: no download; DIR's site tarball copied as it is and its compiled libraries cut to
    FlashMLA's two (what the bench's FlashMLA peers load), so the vLLM pack fits a call beside the fa3 tree."""
    src = tmp_path / "full"
    lib = tmp_path / "lib" / "vllm"
    (lib / "third_party" / "deep_gemm").mkdir(parents=True)
    for name in ("_C_stable_libtorch.abi3.so", "_flashmla_C.abi3.so", "_flashmla_extension_C.abi3.so",
                 "cumem_allocator.abi3.so", "third_party/deep_gemm/_C_extension.abi3.so"):
        (lib / name).write_bytes(name.encode() * 100)
    src.mkdir()
    subprocess.run(f"tar -cf - -C {tmp_path / 'lib'} . | xz > {src / 'vllm_so.tar.xz'}", shell=True, check=True)
    (src / "vllm_site.tar.xz").write_bytes(b"site")
    dest = tmp_path / "vllm_flashmla"
    done = subprocess.run(["bash", str(TOOLS / "pack_vllm.sh"), str(dest)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "SO": "flashmla", "FROM": str(src)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (dest / "vllm_site.tar.xz").read_bytes() == b"site"
    listed = subprocess.run(["tar", "-tJf", str(dest / "vllm_so.tar.xz")], capture_output=True, text=True).stdout
    files = sorted(x for x in listed.split() if x.endswith(".so"))
    assert files == ["./vllm/_flashmla_C.abi3.so", "./vllm/_flashmla_extension_C.abi3.so"], files


_FLASHMLA_OPS_UNDER_SHIMS = """
import importlib.util, json
spec = importlib.util.spec_from_file_location("vllm_device_shims", "tools/vllm_device_shims.py")
shims = importlib.util.module_from_spec(spec); spec.loader.exec_module(shims)
report = shims.install()
import vllm.v1.attention.ops.flashmla as ops
from vllm_kimi_dsa.bench.peers import flashmla as pf
ok, why = ops.is_flashmla_sparse_supported()
names = all(callable(getattr(ops, n)) for n in ("get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_sparse_fwd"))
print(json.dumps({"report": report, "supported": ok, "why": why, "names": names, "vllm": pf.vllm_available()}))
"""


def test_vllm_flashmla_ops_import_under_the_device_shims():
    """vLLM's flashmla ops module (what FLASHMLA_SPARSE imports and the bench's FlashMLA peers call) imports under
    tools/vllm_device_shims.py with vLLM's own tree, as far as a CPU allows: its wrappers are there; without CUDA
    they report FlashMLA unavailable (the compiled library needs libcuda), which the peer reports instead of
    running."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here")
    done = subprocess.run([sys.executable, "-c",
                           _FLASHMLA_OPS_UNDER_SHIMS], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    import json

    res = json.loads(done.stdout.strip().splitlines()[-1])
    assert res["names"] and res["vllm"][0]
    assert set(res["report"]) == {"stable_libtorch", "deep_gemm", "flash_attn", "fused_q_cutedsl"}
    if not res["supported"]:
        assert "_flashmla_C" in res["why"] or "Hopper" in res["why"], res["why"]


def test_dist_info_gives_vllm_the_plugin_entry_point(tmp_path):
    """tools/device_boot/dist_info.py: the package's metadata from pyproject.toml, so importlib.metadata (vLLM's
    plugin loader) finds the entry point where the package is on PYTHONPATH but not pip-installed (the device)."""
    done = subprocess.run([sys.executable, "tools/device_boot/dist_info.py", "pyproject.toml", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    import importlib.metadata

    dists = list(importlib.metadata.distributions(path=[str(tmp_path)]))
    assert [d.metadata["Name"] for d in dists] == ["vllm_kimi_dsa"]
    (entry,) = [e for e in dists[0].entry_points if e.group == "vllm.general_plugins"]
    assert entry.value == "vllm_kimi_dsa.vllm_glue:register"
