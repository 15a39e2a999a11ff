"""The README's measured claims against the committed results they quote: the Hopper backends' table and ratios
from the H100 suite of 2026-12-07, and "What has run where" from that day's test logs.

A number or a pass count in the README that no committed file holds fails here; so does a table left on an older run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "results" / "2026-12-07-h100-layer-suite"
ROWS = (5, 20, 80, 320)  # the README table's columns
ACCURACY_POINT = (320, 128)  # (rows, heads) of its rel L2 column


@pytest.fixture(scope="module")
def readme() -> str:
    return (ROOT / "README.md").read_text()


@pytest.fixture(scope="module")
def suite() -> dict:
    return json.loads((RUN / "bench_suite.json").read_text())


def _section(readme: str, heading: str) -> str:
    start = readme.index(heading)
    following = re.search(r"^#{2,3} ", readme[start + len(heading):], flags=re.M)
    return readme[start: start + len(heading) + (following.start() if following else len(readme))]


def _times(suite: dict, kernel: str, heads: int) -> str:
    cells = []
    for rows in ROWS:
        hit = [r for r in suite["results"] if (r["kernel"], r["heads"], r["rows"]) == (kernel, heads, rows)]
        if not hit:
            return "-"
        cells.append(f"{hit[0]['us']:.1f}")
    return " / ".join(cells)


def _ratios(suite: dict, ours: str, peer: str, heads: int) -> str:
    by_rows = {r["rows"]: r["ratio"] for r in suite["ratios"]
               if (r["ours"], r["peer"], r["heads"]) == (ours, peer, heads)}
    return " / ".join(f"{by_rows[rows]:.2f}" for rows in ROWS)


def test_hopper_backends_table_is_the_committed_suite(readme, suite):
    """Each row of the table names its suite kernel in parentheses; its cells are that kernel's µs at H = 128 and 16
    (5 / 20 / 80 / 320 rows) and its rel L2 at 320 rows x 128 heads, as the committed JSON has them."""
    assert suite["info"]["gpu"] == "NVIDIA H100 80GB HBM3" and suite["info"]["date"].startswith("2026-12-07")
    section = _section(readme, "### vLLM's sparse MLA backends on Hopper")
    assert "**H100 80GB HBM3** on 2026-12-07" in section and "torch 2.11, Triton 3.6" in section
    rows = [line for line in section.splitlines() if line.startswith("| ") and re.search(r"\(([\w-]+/\w+)", line)]
    kernels = [re.search(r"\(([\w-]+/\w+)", line).group(1) for line in rows]
    assert sorted(kernels) == sorted({r["kernel"] for r in suite["results"]} - {"triton/nvfp4_ds_mla"}), kernels
    for line, kernel in zip(rows, kernels):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        (acc,) = [a for a in suite["accuracy"] if (a["kernel"], a["rows"], a["heads"]) == (kernel, *ACCURACY_POINT)]
        assert cells[3:] == [_times(suite, kernel, 128), _times(suite, kernel, 16), f"{acc['rel_l2']:.1e}"], line
        assert acc["within_tolerance"]
    fa = [line for line in section.splitlines() if line.startswith("| FLASH_ATTN_MLA_SPARSE |")]
    assert len(fa) == 1 and fa[0].count("not measured") == 2  # vLLM's FA3 backend: no suite kernel, no number


def test_hopper_ratios_are_the_suites_per_round_medians(readme, suite):
    section = " ".join(_section(readme, "### vLLM's sparse MLA backends on Hopper").split())
    for peer in ("flashmla/fp8_ds_mla", "fa3/fp8"):
        said = f"{_ratios(suite, 'triton/fp8', peer, 128)} and {_ratios(suite, 'triton/fp8', peer, 16)}"
        flashmla_said = f"{_ratios(suite, 'triton/fp8', peer, 128)} of FLASHMLA_SPARSE's time at H = 128 and " \
                        f"{_ratios(suite, 'triton/fp8', peer, 16)} at H = 16"
        assert (flashmla_said if peer.startswith("flashmla") else said) in section, peer


def _summary(log: str) -> dict[str, int]:
    """{"passed": n, "failed": m, ...} of a pytest log's last summary line."""
    last = [line for line in log.splitlines() if re.search(r"\d+ (passed|failed)", line)][-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|deselected|skipped)", last)}


def test_what_has_run_where_says_what_the_logs_show(readme):
    section = _section(readme, "### What has run where")
    layer_log = _summary((RUN / "vllm_layer_and_engine_tests.log").read_text())
    report = json.loads((RUN / "vllm_gpu.json").read_text())
    layer = [line for line in section.splitlines() if "`DeepseekV32Attention` with this backend" in line][0]
    engine = [line for line in section.splitlines() if "engine harness's tests" in line][0]
    assert f"{layer_log['passed']} layer tests" in layer and f"{layer_log['passed']} passed" in layer
    assert f"{layer_log['failed']} failed" in engine and "IndexError: tuple index out of range" in \
        (RUN / "vllm_layer_and_engine_tests.log").read_text()
    errors = [v["layer_rel_l2"] for v in report.values() if isinstance(v, dict) and "layer_rel_l2" in v]
    assert f"rel L2 {min(errors) * 1e3:.1f}-{max(errors) * 1e3:.1f}e-3" in layer
    assert all(v == "caught" for v in report["negative_controls"].values())
    graphs = [size for key, layout in report.items() if key.startswith("graph_") for size in layout.values()]
    assert graphs and all(g["bit_equal"] and g["replay_allocations"] == 0 for g in graphs)
    card, torch_version = report["gpu"]["name"], report["gpu"]["torch"]
    assert card == "NVIDIA H100 80GB HBM3" and torch_version.startswith("2.11")
    by_hand = [line for line in section.splitlines() if "vLLM's engine (`LLM(...)`" in line][0]
    assert "three hand fixes" in by_hand and "superseded" in by_hand
    harness = [line for line in section.splitlines() if "vLLM's engine through the project's harness" in line][0]
    assert "| 2026-12-07 | H100 80GB HBM3 | 2.11 / 3.6 |" in harness and "2026-12-07-h100-engine" in harness
    assert "the 5% softmax scale not" in harness and "64 heads not run" in harness
    for line in (layer, engine, by_hand):
        assert "| 2026-12-07 | H100 80GB HBM3 | 2.11 / 3.6 |" in line
    kernels = _summary((RUN / "head_count_tests.log").read_text())["passed"]
    combine = _summary((RUN / "combine_tests.log").read_text())["passed"]
    assert f"| {kernels} and {combine} passed |" in section
    assert "torch 2.11 and Triton 3.6" in section and "torch 2.14 and Triton 3.8" in section
    not_run = " ".join(section[section.index("Not run anywhere yet"):].split())
    for missing in ("`vllm serve`", "anything on Blackwell", "DCP across GPUs"):
        assert missing in not_run
    assert "every GPU test passed" not in readme



def test_the_device_doc_lists_what_the_engine_runs_with_there():
    """docs/vllm-on-device.md: what the device replaces or switches for vLLM's engine (each with why it cannot flatter
    this backend), and every shim the H100 report says acted there (not "real library loads") in its shims table."""
    doc = (ROOT / "docs" / "vllm-on-device.md").read_text()
    assert "Nothing of the engine is replaced" not in doc
    table = doc[doc.index("| replaced or switched | why | why it cannot flatter this backend |"):]
    table = table[: table.index("\n\n")]
    rows = table.splitlines()[2:]
    for switched in ("`flash_attn` shim", "sparse_mla_force_mqa", "`VLLM_USE_FLASHINFER_SAMPLER=0`",
                     "torch 2.11 and Triton 3.6"):
        (row,) = [r for r in rows if switched in r.split("|")[1]]
        assert len(row.split("|")[3].strip()) > 40, row  # the reason it cannot flatter is given
    report = json.loads((RUN / "vllm_gpu.json").read_text())
    acted = [name for name, said in report["shims"].items() if said != "real library loads"]
    assert acted == ["flash_attn", "fused_q_cutedsl"]
    for name in acted:
        assert f"| `{name}` |" in doc


ENGINE = ROOT / "benchmarks" / "results" / "2026-12-07-h100-engine"


def test_the_earlier_engine_rows_are_the_committed_run_and_only_its_full_batches(readme):
    """docs/results.md's table of the earlier engine method: each row's cells from the committed engine.json (GPU µs,
    attention µs and floor fractions, the ratios), and exactly the points whose every window was pure decode (the
    scheduler showed the others' batches shrinking). The README quotes none of them, nor the earlier check's claim
    that a 5% error sits inside the correct engines' spread; its check rows come from the committed report."""
    import gzip

    doc = (ROOT / "docs" / "results.md").read_text()
    section = doc[doc.index("## vLLM's engine, the earlier method"):doc.index("## vLLM on the GPU")]
    rows = {(r["heads"], r["requests"], r["context_mix"], r["backend"]): r
            for h in ("h16", "h128") for r in json.loads((ENGINE / h / "engine.json").read_text())}
    pure = {k[:3] for k, r in rows.items() if r["pure_decode"] and rows[(*k[:3], "FLASHMLA_SPARSE")]["pure_decode"]}
    lines = [line for line in section.splitlines() if re.match(r"\| (16|128) \| \d+ \| (uniform|ragged)", line)]
    shown = set()
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        heads, requests = int(cells[0]), int(cells[1])
        mix = "uniform-4096" if cells[2].startswith("uniform") else "ragged-100-8000"
        shown.add((heads, requests, mix))
        a, b = rows[heads, requests, mix, "FLASHINFER_MLA_SPARSE"], rows[heads, requests, mix, "FLASHMLA_SPARSE"]
        assert cells[3] == f"{a['gpu_us']:,.0f} / {b['gpu_us']:,.0f}", line
        frac = lambda r: f" ({r['attention_floor_fraction']:.2f})"  # noqa: E731
        assert cells[4] == f"{a['attention_us']:.0f}{frac(a)} / {b['attention_us']:.0f}{frac(b)}", line
        assert cells[5] == f"{a['attention_us'] / b['attention_us']:.2f}x", line
        assert cells[6] == f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x / {b['gpu_us'] / a['gpu_us']:.2f}x", line
    assert shown == pure and len(shown) == 10
    engine = _section(readme, "## vLLM's engine, decode step by step")
    assert not re.search(r"\| (16|128) \| \d+ \|", engine) and "no (batch shrank)" not in readme
    assert "sits inside that spread" not in readme and "confident token flip" not in readme
    report = json.loads(gzip.decompress((H200_RUN / "3-one-layer-check-261a26a" / "logs" / "engine1" /
                                         "engine_report.json.gz").read_bytes()))["heads"]["16"]["compare"]
    same = "FLASHINFER_MLA_SPARSE_SM90+fp8q"
    gross = [report[f"eager:{f} vs {same}"]["max"] for f in ("slot_off_by_one", "half_topk", "topk_ignored")]
    said = (f"this backend {report[f'FLASHINFER_MLA_SPARSE vs {same}']['max']:.3f}, the 5% softmax scale "
            f"{report[f'eager:softmax_scale vs {same}']['max']:.2f}, the other faults "
            f"{min(gross):.2f}-{max(gross):.2f}")
    (row,) = [line for line in _section(readme, "### What has run where").splitlines() if "at one layer" in line]
    assert said in row and "| 2026-12-07 | H200 | 2.11 / 3.6 |" in row


H200_RUN = ROOT / "benchmarks" / "results" / "2026-12-07-h200-issue54"


def _progress(log: str) -> str:
    """pytest -q's progress characters of a log (a run cut by its time limit prints no summary line)."""
    lines = [re.sub(r"\s*\[\s*\d+%\]$", "", line.strip()) for line in log.splitlines()]
    return "".join(line for line in lines if line and set(line) <= set(".FEsxX"))


def test_what_has_run_where_says_what_the_h200_logs_show(readme):
    """The H200 rows of 2026-12-07: the GPU list on 8c5433a and 261a26a (progress counted from the logs), the engine
    at 64 / 128 heads on both trees."""
    section = _section(readme, "### What has run where")
    row = [line for line in section.splitlines() if "on the tree before the issue-54 merge" in line][0]
    runs = H200_RUN / "6-gpu-tests-8c5433a-vs-261a26a"
    pre, head = (_progress((runs / tree / "1_tests.log").read_text()) for tree in ("pre", "head"))
    assert f"8c5433a: {len(pre)} run, {pre.count('F')} failed" in row and pre.count("F") == 0
    assert f"261a26a: {len(head)} run, {head.count('F')} failed" in row
    assert "| 2026-12-07 | H200 | 2.11 / 3.6 |" in row and "2026-12-07-h200-issue54" in row
    engine = [line for line in section.splitlines() if "timing only, 64 and 128 heads" in line][0]
    table = (H200_RUN / "2-engine-8c5433a-heads-64-128" / "pre" / "logs" / "engine" / "engine.md").read_text()
    ratios = [float(c) for c in re.findall(r"\| (\d\.\d\d)x \| \d\.\d\dx \| \d\.\d\dx \| yes \|", table)]
    assert len(ratios) == 16 and f"attention {min(ratios):.2f}-{max(ratios):.2f}x" in engine
    died = (H200_RUN / "1-engine-261a26a-heads-64-128-16" / "logs" / "engine" / "h64_ours.log").read_text()
    assert "Assertion `idx < size()' failed" in died and "idx < size()" in engine
