#!/usr/bin/env bash
# vLLM 0.33's own Python code for the device machine (Python 3.12, torch 2.11, Triton 3.6, no vLLM, no internet: SPEC
# 11), packed here from pinned cp312 wheels for `bash tools/device_run.sh --vllm ...` to put ahead of site-packages.
#   bash tools/pack_vllm.sh [DEST]       (default .carry/vllm; run here, not on the device)
# DEST/vllm_site.tar.xz: vLLM's Python tree (no compiled library) and the pure-Python / cp312 packages its imports
# need that the device image lacks ($PINS). Trimmed: every vllm .so, vllm/vllm-rs (a 60 MB binary), the non-Python
# files of vllm/third_party (CUTLASS / DeepGEMM headers), the API server's swagger assets, tvm_ffi's headers and
# sources, __pycache__, *.pyi.
# DEST/vllm_so.tar.xz (optional, unpacked over the site by --vllm): the compiled libraries in $SO, each CUDA fatbin
# cut to sm_$SM cubins (PTX kept only where a translation unit has no sm_$SM cubin) so they fit a device call.
# Environment: SO="..." paths under vllm/ (default $SO_DEFAULT; SO=none: no tarball; SO=flashmla: FlashMLA's two
# libraries alone, _flashmla_C + _flashmla_extension_C, ~1 MB xz, what the bench's FlashMLA peers load: with it the
# vLLM pack, the fa3 tree and the repo fit one device call; _moe_C_stable_libtorch.abi3.so adds MoE ops, +18 MB);
# SM=90 (SM=all keeps every image); FROM=DIR: no download, DIR's pack reused (its vllm_site.tar.xz as it is, its
# vllm_so.tar.xz cut to $SO); CHECK_PY=PYTHON runs tools/vllm_device_shims.py against the unpacked pack under that
# Python (a replica of the device's, e.g. /tmp/devenv/bin/python; CUDA_VISIBLE_DEVICES="").
# The bench's pack: SO=flashmla FROM=.carry/vllm bash tools/pack_vllm.sh .carry/vllm_flashmla   (seconds; ~18 MB)
# then: bash tools/device_run.sh --vllm .carry/vllm_flashmla suite ...   (carry .carry/vllm_flashmla)
set -eu -o pipefail
PINS="vllm==0.33.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  pyzmq==27.3.0 cbor2==6.3.0 cachetools==8.0.3 msgspec==0.23.0 pybase64==1.5.1 partial-json-parser==0.2.1.1.post7
  fastapi==0.136.3 starlette==1.10.0 openai==3.63.0 httpx2==2.17.0 sniffio==1.3.1 oss-harmony==0.0.11
  xgrammar==0.2.8 apache-tvm-ffi==0.1.11 llguidance==1.7.6 compressed-tensors==0.17.0 loguru==0.7.3"
SO_DEFAULT="_C_stable_libtorch.abi3.so _flashmla_C.abi3.so _flashmla_extension_C.abi3.so cumem_allocator.abi3.so
  third_party/deep_gemm/_C_extension.abi3.so third_party/deep_gemm/include"
SO_FLASHMLA="_flashmla_C.abi3.so _flashmla_extension_C.abi3.so"
SO=${SO:-$SO_DEFAULT}; SM=${SM:-90}
[ "$SO" != flashmla ] || SO=$SO_FLASHMLA
ROOT=$(pwd); DEST=${1:-.carry/vllm}; mkdir -p "$DEST"; DEST=$(cd "$DEST" && pwd)
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT

pack() {  # DIR TARBALL: reproducible tar (sorted, fixed owner and time), xz -9e
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - -C "$1" . | xz -9e -T0 > "$2"
  echo "$(basename "$2"): $(du -b "$2" | cut -f1) bytes ($(du -sb "$1" | cut -f1) unpacked)"
}

if [ -n "${FROM:-}" ]; then  # another pack's site as it is, its compiled libraries cut to $SO (already sm_90)
  [ -f "$FROM/vllm_site.tar.xz" ] || { echo "FROM=$FROM holds no vllm_site.tar.xz" >&2; exit 1; }
  [ "$(cd "$FROM" && pwd)" = "$DEST" ] || cp "$FROM/vllm_site.tar.xz" "$DEST/vllm_site.tar.xz"
  [ ! -f "$FROM/CONTENTS" ] || [ "$(cd "$FROM" && pwd)" = "$DEST" ] || cp "$FROM/CONTENTS" "$DEST/CONTENTS"
  if [ "$SO" = none ]; then rm -f "$DEST/vllm_so.tar.xz"; exit 0; fi
  [ -f "$FROM/vllm_so.tar.xz" ] || { echo "FROM=$FROM holds no vllm_so.tar.xz to cut to: $SO" >&2; exit 1; }
  mkdir -p "$W/all" "$W/so/vllm" && tar -xJf "$FROM/vllm_so.tar.xz" -C "$W/all"
  for p in $SO; do
    [ -e "$W/all/vllm/$p" ] || { echo "$FROM/vllm_so.tar.xz has no vllm/$p" >&2; exit 1; }
    mkdir -p "$W/so/vllm/$(dirname "$p")" && cp -r "$W/all/vllm/$p" "$W/so/vllm/$p"
  done
  pack "$W/so" "$DEST/vllm_so.tar.xz"
  exit 0
fi

# llguidance 1.7.6 is manylinux_2_31 only (glibc >= 2.31; the device's Python 3.12.3 is Ubuntu 24.04's, glibc 2.39)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --abi none --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform any -d "$W/whl" $PINS
mkdir -p "$W/site" && for w in "$W"/whl/*.whl; do (cd "$W/site" && python3 -m zipfile -e "$w" .); done

S=$W/site; V=$S/vllm
mkdir -p "$W/so/vllm"
if [ "$SO" != none ]; then
  for p in $SO; do mkdir -p "$W/so/vllm/$(dirname "$p")" && cp -r "$V/$p" "$W/so/vllm/$p"; done
fi
find "$V" -name '*.so' -delete
rm -rf "$V/vllm-rs" "$V/entrypoints/serve/instrumentator/static" "$S"/tvm_ffi/{3rdparty,include,src,cython,share} \
  "$S/tvm_ffi/CMakeLists.txt"
find "$V/third_party" -type f ! -name '*.py' -delete
find "$S" -name __pycache__ -prune -exec rm -rf {} + ; find "$S" -name '*.pyi' -delete
find "$S" -type d -empty -delete

# sm_$SM only: each fatbin's entries rewritten in place (kept ones moved to the front, the rest zeroed, the header's
# size updated); the ELF layout, symbols and host code are untouched
mapfile -t sos < <(find "$W/so" -name '*.so' | sort)
[ "$SM" = all ] || [ ${#sos[@]} = 0 ] || python3 - "$SM" "${sos[@]}" <<'EOF'
import struct, sys
MAGIC, sm = struct.pack("<I", 0xBA55ED50), int(sys.argv[1])
for path in sys.argv[2:]:
    data, i, before, after = bytearray(open(path, "rb").read()), 0, 0, 0
    while (i := data.find(MAGIC, i)) >= 0:
        hsize, fsize = struct.unpack_from("<HQ", data, i + 6)
        start, end, j, entries = i + hsize, i + hsize + fsize, i + hsize, []
        while j < end:  # entry: kind (1 PTX, 2 ELF), header size, payload size, ..., arch at +28
            kind, ehsize, psize = struct.unpack_from("<H2xIQ", data, j)
            entries.append((kind, struct.unpack_from("<I", data, j + 28)[0], bytes(data[j:j + ehsize + psize])))
            j += ehsize + psize
        keep = [e for e in entries if e[0] == 2 and e[1] == sm]
        ptx = [e for e in entries if e[0] == 1 and e[1] <= sm]
        # no image runs on sm_<sm>: keep the smallest entry (a fatbin with no compatible image, as before)
        keep = keep or ([max(ptx, key=lambda e: e[1])] if ptx else [min(entries, key=lambda e: len(e[2]))])
        body = b"".join(e[2] for e in keep)
        data[start:end] = body + bytes(fsize - len(body))
        struct.pack_into("<Q", data, i + 8, len(body))
        before, after, i = before + fsize, after + len(body), end
    open(path, "wb").write(data)
    print(f"{path.split('/so/')[-1]}: fatbins {before / 1e6:.1f} -> {after / 1e6:.1f} MB (sm_{sm})")
EOF

pack "$S" "$DEST/vllm_site.tar.xz"
rm -f "$DEST/vllm_so.tar.xz"; [ "$SO" = none ] || pack "$W/so" "$DEST/vllm_so.tar.xz"
ls "$S" | grep dist-info | sed 's/\.dist-info$//' | tr '\n' ' ' > "$DEST/CONTENTS"; echo >> "$DEST/CONTENTS"

if [ -n "${CHECK_PY:-}" ]; then  # the pack under a replica of the device's Python: imports, configs, shims
  C=$W/check; mkdir -p "$C" && tar -xJf "$DEST/vllm_site.tar.xz" -C "$C"
  [ ! -f "$DEST/vllm_so.tar.xz" ] || tar -xJf "$DEST/vllm_so.tar.xz" -C "$C"
  (cd "$ROOT" && CUDA_VISIBLE_DEVICES="" PYTHONPATH="$C:$ROOT" "$CHECK_PY" tools/vllm_device_shims.py)
fi
