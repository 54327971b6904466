"""smp installs the ordinary ways, into a fresh virtual environment that already has torch.

Each case makes a new venv that sees this interpreter's third-party packages (torch, pydantic,
...) through a .pth file, but not smp or smp_collectives, so nothing is pulled from an index
and another torch is never installed. Then it installs the project one way and, from a
directory outside the repository, imports both packages and runs the `smp` command.
The builds go through pip's build isolation like a user's would (setuptools from the index).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import smp
from tests import REPO_ROOT

ROOT = REPO_ROOT
pytestmark = pytest.mark.slow

# Ours: never visible to the fresh venv (it must get them from what it installs).
_OWN = ("smp", "smp_collectives", "smp_parallel", "smp_collectives", "__editable__")


def _clean_env() -> dict[str, str]:
    # Nothing of the calling environment may point the fresh venv at this checkout.
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _imports_smp(python: Path, cwd: Path) -> bool:
    return subprocess.run([str(python), "-c", "import smp"], cwd=cwd, env=_clean_env(), capture_output=True).returncode == 0


def _run(cmd: list[str], cwd: Path, timeout: float = 600) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} -> {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _fresh_venv(tmp: Path) -> Path:
    """A venv whose site-packages links to ours, minus smp's own packages; returns its python."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, env=_clean_env())
    python = venv / "bin" / "python"
    shared = tmp / "shared-site"
    shared.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        name = entry.name.lower().replace("-", "_")
        if name.startswith(_OWN) or entry.suffix == ".pth" or name in ("pip", "setuptools", "_distutils_hack") \
                or name.startswith(("pip_", "setuptools_")):
            continue
        (shared / entry.name).symlink_to(entry)
    target_site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp).strip())
    (target_site / "_shared_site.pth").write_text(f"{shared}\n")
    # The fresh venv must not see smp before we install it (the negative control of every case).
    assert not _imports_smp(python, tmp), "the fresh venv already imports smp: the test would prove nothing"
    _run([str(python), "-c", "import torch, pydantic, yaml"], tmp)
    return python


def _check_installed(python: Path, cwd: Path) -> None:
    out = _run([str(python), "-c", "import smp, smp_collectives, smp_collectives.triton_kernels; "
                "print(smp.__version__, smp.__file__, smp_collectives.__file__)"], cwd)
    version, smp_file, kernels_file = out.split()
    assert version == smp.__version__
    # Imported from the venv, not from the clone.
    assert not smp_file.startswith(str(ROOT)) and not kernels_file.startswith(str(ROOT)), out
    bindir = python.parent
    assert _run([str(bindir / "smp"), "--version"], cwd).strip() == f"smp {smp.__version__}"
    assert _run([str(python), "-m", "smp", "--version"], cwd).strip() == f"smp {smp.__version__}"
    out = _run([str(bindir / "smp"), "check", str(ROOT / "examples" / "configs" / "hybrid.yaml"), "--world-size", "4"], cwd)
    assert "hybrid" in out.lower() or "replicate" in out.lower(), out
    # The installed metadata carries the same single-sourced version.
    meta = _run([str(python), "-c", "import importlib.metadata as m; print(m.version('smp-parallel'))"], cwd)
    assert meta.strip() == smp.__version__


def _clean_copy(tmp: Path) -> Path:
    """The repository's tracked files, as a fresh clone has them (no .venv, no build leftovers)."""
    src = tmp / "src"
    files = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], ROOT).split("\0")
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    return src


def test_pip_install_from_a_clone(tmp_path):
    python = _fresh_venv(tmp_path)
    src = _clean_copy(tmp_path)
    _run([str(python), "-m", "pip", "install", "-q", f"{src}[hf,metrics]"], tmp_path)
    _check_installed(python, tmp_path)
    # pip resolved no second torch: the linked one is the only one.
    out = _run([str(python), "-c", "import torch; print(torch.__file__)"], tmp_path)
    assert "shared-site" in out, out


def test_wheel_and_sdist_carry_both_packages(tmp_path):
    src = _clean_copy(tmp_path)
    _run([sys.executable, "-m", "build", "--outdir", str(tmp_path / "dist"), str(src)], tmp_path)
    wheels = list((tmp_path / "dist").glob("smp_parallel-*.whl"))
    sdists = list((tmp_path / "dist").glob("smp_parallel-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list((tmp_path / "dist").iterdir())
    names = zipfile.ZipFile(wheels[0]).namelist()
    for required in ("smp/__init__.py", "smp/py.typed", "smp_collectives/triton_kernels.py", "smp_collectives/py.typed"):
        assert required in names, required
    assert not any(n.startswith(("tests/", "bench/", "kernels/")) for n in names)
    # `build` makes the wheel from the sdist, so a file the sdist lacks is missing above. The wheel
    # installed and run is test_pip_install_from_a_clone's (pip builds it from the same sources).


@pytest.mark.long  # the same build as the clone's, fetched through git (30 s): -m long
def test_git_url_install(tmp_path):
    # A git URL the way users write it, served from a local clone of the working tree.
    src = _clean_copy(tmp_path)
    _run(["git", "init", "-q"], src)
    _run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A"], src)
    _run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "snapshot"], src)
    python = _fresh_venv(tmp_path)
    # (file://localhost/...: pip 23's requirement parser wants a host in a git+file URL.)
    _run([str(python), "-m", "pip", "install", "-q", f"smp-parallel @ git+file://localhost{src}"], tmp_path)
    _check_installed(python, tmp_path)


def test_kernels_install_on_their_own(tmp_path):
    src = _clean_copy(tmp_path)
    python = _fresh_venv(tmp_path)
    _run([str(python), "-m", "pip", "install", "-q", str(src / "kernels")], tmp_path)
    out = _run([str(python), "-c", "import smp_collectives, importlib.metadata as m; "
                "print(smp_collectives.__version__, m.version('smp-collectives'))"], tmp_path)
    version, meta = out.split()
    assert version == meta
    assert not _imports_smp(python, tmp_path)  # only the kernels came with it
