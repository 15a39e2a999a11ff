"""Writes this package's dist-info (METADATA, entry_points.txt) from pyproject.toml into a site folder: on the device,
where nothing is pip-installed, vLLM's plugin loader (importlib.metadata entry points, group vllm.general_plugins)
then finds the backend as it does after `pip install`. Seen on the H100 (2026-12-07): without it the engine never
loads the plugin and vLLM's own FLASHINFER_MLA_SPARSE refuses SM90 ("compute capability not supported").

    python3 tools/device_boot/dist_info.py PYPROJECT SITE_DIR
"""

import pathlib
import sys
import tomllib


def write(pyproject: pathlib.Path, site: pathlib.Path) -> pathlib.Path:
    project = tomllib.loads(pyproject.read_text())["project"]
    folder = site / f"{project['name']}-{project['version']}.dist-info"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    groups = project.get("entry-points", {})
    (folder / "entry_points.txt").write_text(
        "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n"
                for group, entries in groups.items())
    )
    return folder


if __name__ == "__main__":
    print(write(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])))
