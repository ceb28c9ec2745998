"""The package layout: the checkout's top-level folders are the subpackages of `dsv41c`."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_checkout_imports_its_subpackages_without_an_editable_install():
    """`python -m pytest` in the repository root puts the checkout's `dsv41c` folder ahead of an
    installed copy. Without an editable install's import hook (`-S`: no site hooks; the libraries
    come from PYTHONPATH) dsv41c.passes, dsv41c.tilelang_kernels and dsv41c.cli must still resolve,
    to the top-level folders (pyproject.toml's package-dir)."""
    libs = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    code = ("import dsv41c.passes, dsv41c.tilelang_kernels, dsv41c.cli.main; "
            "print(dsv41c.passes.__file__); print(dsv41c.tilelang_kernels.__file__)")
    proc = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(libs)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [Path(line) for line in proc.stdout.split()] == [REPO / "passes" / "__init__.py",
                                                            REPO / "tilelang_kernels" / "__init__.py"]
