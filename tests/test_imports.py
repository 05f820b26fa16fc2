"""Nothing on the import path is POSIX-only: every kvboost module imports with `fcntl` hidden
(as on Windows), in a fresh interpreter."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from test_fetch import blocked_env, write_import_blocker

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvboost_engine", "kvboost_integrations", "kvboost_tools")


def all_modules() -> list[str]:
    names = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(n for n in names if not n.endswith("__main__"))


def test_every_module_imports_without_fcntl(tmp_path):
    modules = all_modules()
    assert len(modules) > 80 and "kvboost_engine.paths" in modules
    write_import_blocker(tmp_path, ["fcntl"])
    code = ("import importlib, sys\n"
            "try:\n    import fcntl\nexcept ModuleNotFoundError:\n    pass\nelse:\n    raise SystemExit('fcntl not hidden')\n"
            f"for name in {modules!r}:\n    importlib.import_module(name)\n"
            "assert 'fcntl' not in sys.modules\n"
            "print('imported', len(sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=blocked_env(tmp_path), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("imported")
