"""Release packaging: the licence and the third-party notices are in the repository and in the
wheel; the notices name every dependency; the wheel and the sdist build and install, with the web
UI's files and the commands."""
import configparser
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def test_licence_and_notices_name_every_dependency():
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    reqs = cfg["options"]["install_requires"].split("\n")
    reqs += [r for e in cfg["options.extras_require"].values() for r in e.split("\n")]
    names = {_norm(Requirement(r).name) for r in reqs if r.strip()}
    rows = (ROOT / "THIRD_PARTY_NOTICES.md").read_text().lower().replace("_", "-").replace(".", "-")
    missing = sorted(n for n in names if f"| {n} |" not in rows)
    assert not missing, f"THIRD_PARTY_NOTICES.md lacks {missing}: run python -m scripts.notices > THIRD_PARTY_NOTICES.md"
    assert set(cfg["metadata"]["license_files"].split()) == {"LICENSE", "THIRD_PARTY_NOTICES.md"}


def test_a_model_card_per_family():
    from infernix_jax.config import HF_FAMILIES as FAMILIES
    index = (ROOT / "docs/models/README.md").read_text()
    for fam in set(FAMILIES.values()):
        card = ROOT / "docs/models" / f"{fam}.md"
        assert card.exists() and f"({fam}.md)" in index, fam
        assert "Verified against transformers" in card.read_text()


@pytest.mark.extended           # (~1 min: two builds in isolated environments, then two installs)
def test_wheel_and_sdist_build_and_install(tmp_path):
    import shutil
    src, dist = tmp_path / "src", tmp_path / "dist"       # (a copy: the build writes nothing into the checkout)
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(dist), str(src)],
                   check=True, capture_output=True)
    wheel, sdist = next(dist.glob("*.whl")), next(dist.glob("*.tar.gz"))
    names = zipfile.ZipFile(wheel).namelist()
    for want in ("licenses/LICENSE", "licenses/THIRD_PARTY_NOTICES.md", "entry_points.txt"):
        assert any(n.endswith(want) and ".dist-info/" in n for n in names), want
    assert {"server/static/index.html", "server/static/chat.js", "pallas_kernels/__init__.py"} <= set(names)
    assert not [n for n in names if n.startswith("tests/")]
    members = tarfile.open(sdist).getnames()
    for want in ("LICENSE", "THIRD_PARTY_NOTICES.md", "setup.cfg", "pyproject.toml", "server/static/index.html"):
        assert any(m.endswith("/" + want) for m in members), want
    for art in (wheel, sdist):         # each installs (the sdist builds a wheel of its own), then imports
        target = tmp_path / art.name.split("-")[1].split(".tar")[0]
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(art)],
                       check=True, capture_output=True)
        out = subprocess.run([sys.executable, "-c", "import server.app, scripts.serve, infernix_jax, pathlib; "
                              "print(pathlib.Path(server.app.__file__).parent)"],
                             cwd=tmp_path, env={"PYTHONPATH": str(target), "JAX_PLATFORMS": "cpu"},
                             check=True, capture_output=True, text=True)
        assert Path(out.stdout.strip()) == target / "server"                   # (the installed copy)
        assert (target / "server/static/index.html").exists()
        assert any((target / "bin").glob("infernix-serve")) or any(target.glob("*.dist-info/entry_points.txt"))
